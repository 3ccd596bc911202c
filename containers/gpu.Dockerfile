# GPU training image: `python -m training.gpu` (and precompute, bench, export) exactly as the venv
# runs them, from the SAME pins as the lifecycle's /fsx/envs/gpu (training/requirements-gpu.txt).
# Built by `make image IMAGE=gpu` (containers/image.py), run on the cluster by enroot/pyxis
# (runbooks/containers.md). The build context is staged by containers/image.py: training/ only,
# the files stacks/cluster.py package_hash covers, so the image label names the exact package.
#
# Base: an AWS Deep Learning Container of the torch line requirements-gpu.txt pins, so pip finds
# torch already satisfied and installs only the rest (tag scheme:
# https://aws.github.io/deep-learning-containers/reference/available_images/#pytorch-training).
# Any base with python3 (>= 3.11) and venv works: the test builds it on a Debian minbase.
ARG BASE_IMAGE=public.ecr.aws/deep-learning-containers/pytorch-training:2.13.0-gpu-py312-cu130-ubuntu24.04-ec2
FROM ${BASE_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
USER 0

# The network stack: the DLC already ships EFA, libfabric and the aws-ofi-nccl plugin, built
# and tested together ("an AWS-tuned, version-MATCHED EFA stack baked in (EFA 1.47.0 ->
# libfabric 2.4 + aws-ofi-nccl 1.18.0 ...)", awslabs/awsome-distributed-ai
# 3.test_cases/pytorch/cosmos3/Dockerfile, which keeps it and its LD_LIBRARY_PATH untouched; as
# does 3.test_cases/pytorch/nvrx/Dockerfile, "AWS PyTorch DLC with EFA support as base"). A
# reinstall over it can leave NCCL with a plugin it cannot use, and NCCL then falls back to TCP
# sockets without failing (the smoke job's gpu-allreduce row catches that). So by default
# nothing is installed here (INSTALL_EFA=0).
#
# INSTALL_EFA=1 (`make image EFA=1`: a base without EFA, or a newer EFA than the base's):
# the EFA installer as awslabs/awsome-distributed-ai micro-benchmarks/nccl-tests/
# nccl-tests.Dockerfile runs it in a container: no kernel module and no limits file (both
# belong to the host: --skip-kmod --skip-limit-conf), no verification (no EFA device at build
# time: --no-verify), -g for GPUDirect RDMA; the sample's -d (--debug-packages) is left out,
# debug symbols only grow the image. The installer bundles the aws-ofi-nccl plugin matched to its
# libfabric (that Dockerfile: AWS_OFI_NCCL_VERSION "is ignored as plugin is bundled with EFA"),
# so the one pin is EFA_INSTALLER_VERSION. Then what breaks NCCL inside a container
# (awsome-distributed-ai issue #873, same Dockerfile): cuda-compat (the host driver must win,
# pyxis mounts it) and the bundled HPC-X / MPI whose libraries shadow the EFA-built ones. And
# that Dockerfile's library path, so NCCL finds the plugin and libfabric first: containers/
# image.py passes it as EFA_LD_LIBRARY_PATH (ending in ':') only with EFA=1, and it is put in
# front of the base's LD_LIBRARY_PATH below; with EFA=0 the base's is kept as it is.
ARG INSTALL_EFA=0
ARG EFA_INSTALLER_VERSION=1.50.0
ARG EFA_LD_LIBRARY_PATH=""
# The installer sources ./env.sh, so it runs from its own directory.
WORKDIR /tmp/aws-efa-installer
# curl/ca-certificates are whatever the base distro's release ships (only fetch the installer).
# hadolint ignore=DL3008
RUN if [ "${INSTALL_EFA}" = 1 ]; then \
      apt-get update \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends curl ca-certificates \
      && curl -fsSL "https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" \
         | tar -xz --strip-components=1 \
      && ./efa_installer.sh -y -g --skip-kmod --skip-limit-conf --no-verify \
      && (apt-get purge -y 'cuda-compat-*' || true) \
      && rm -rf /opt/hpcx /usr/local/mpi /etc/ld.so.conf.d/hpcx.conf \
      && ldconfig \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
    && rm -rf /tmp/aws-efa-installer
ENV LD_LIBRARY_PATH=${EFA_LD_LIBRARY_PATH}${LD_LIBRARY_PATH}
WORKDIR /opt/sana
# No FI_*/NCCL_* settings baked in: pyxis hands the job's environment (the node profile's
# NCCL/EFA settings, lifecycle_scripts/node_profile.sh) into the container unchanged.
ENV PATH=/opt/amazon/openmpi/bin:/opt/amazon/efa/bin:${PATH}

# The training env: a venv over the base's Python (--system-site-packages, so the base's CUDA
# torch satisfies the torch pin and is not downloaded again), from the one requirements file the
# cluster's venv is built from. pip check fails the build on an inconsistent set.
# PIP_* build args are pip's own settings (https://pip.pypa.io/en/stable/topics/configuration/)
# and become plain environment in RUN: a private index, a local wheel directory, the CA bundle of
# a TLS-inspecting proxy; never pins.
ARG PIP_INDEX_URL
ARG PIP_CERT
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
COPY training/requirements-gpu.txt /opt/sana/requirements.txt
RUN python3 -m venv --system-site-packages /opt/sana/venv \
    && /opt/sana/venv/bin/python -m pip install --no-cache-dir --disable-pip-version-check \
         -r /opt/sana/requirements.txt \
    && /opt/sana/venv/bin/python -m pip check

# The package last: a code change rebuilds only this layer. Read-only for the job user, as on FSx.
COPY training /opt/sana/training
# Provenance, written by containers/image.py into the build context: SANA_IMAGE_PACKAGE_HASH
# (stacks/cluster.py package_hash of lifecycle_scripts/ + training/, the name the lifecycle
# installs the package under on FSx), SANA_IMAGE_REQUIREMENTS_HASH, SANA_IMAGE_REVISION. The
# same values are the image labels sana.package-hash, sana.requirements-hash and
# org.opencontainers.image.revision (`--label` at build time). A file, not ARG + LABEL/ENV:
# buildah's layer cache keys LABEL/ENV by their unexpanded text and would keep a previous
# build's hash; COPY is keyed by content. launch.sh reads it inside the container.
COPY image.env /opt/sana/image.env
ARG SANA_UID=10001
RUN useradd --uid "${SANA_UID}" --user-group --no-create-home --home-dir /tmp --shell /bin/bash sana \
    && python3 -m compileall -q /opt/sana/training
ENV PATH=/opt/sana/venv/bin:${PATH} \
    PYTHONPATH=/opt/sana \
    PYTHONUNBUFFERED=1
USER ${SANA_UID}

LABEL org.opencontainers.image.title="sana-gpu" \
      sana.requirements-file="training/requirements-gpu.txt"
CMD ["python", "-m", "training.gpu", "--help"]
