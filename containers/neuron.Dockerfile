# Trainium training image: `python -m training.trainium` exactly as /fsx/envs/neuron runs it, from
# the SAME pins (training/requirements-neuron.txt: Neuron SDK 2.31.1, torch 2.9 + torch-xla 2.9).
# Built by `make image IMAGE=neuron` (containers/image.py), run by enroot/pyxis with the host's
# /dev/neuron* devices (runbooks/containers.md).
#
# Base: the AWS Neuron training DLC of the SDK release requirements-neuron.txt pins. Tag scheme
# <torch>-neuronx-<py>-sdk<release>-<os>, e.g. 2.9.0-neuronx-py312-sdk2.27.1-ubuntu24.04 in the
# Neuron DLC table (aws-neuron/deep-learning-containers README; docs "Neuron Deep Learning
# Containers"; aws/deep-learning-containers docs/src/data lists the 2.31.1 inference image,
# 2.9-neuronx-sdk2.31.1.yml); check the 2.31.1 training tag exists in your region before a
# first build (or pass --build-arg BASE_IMAGE=<the sdk2.29.0 tag>: pip then installs the
# pinned 2.31.1 packages over it, but the runtime libraries stay the DLC's). The DLC
# already carries the Neuron runtime libraries, the collectives and the EFA userspace the
# Neuron runtime uses, so this file adds no EFA stage; the Neuron driver stays on the host.
ARG BASE_IMAGE=public.ecr.aws/neuron/pytorch-training-neuronx:2.9.0-neuronx-py312-sdk2.31.1-ubuntu24.04
FROM ${BASE_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
USER 0
WORKDIR /opt/sana

# The venv sees the DLC's torch-neuronx / neuronx-cc / libneuronxla (--system-site-packages):
# when they match the pins pip keeps them; any mismatch is replaced by the pinned version from
# the Neuron repository, so the image never runs other versions than the cluster's venv.
# torch-neuronx, neuronx-cc and libneuronxla exist on the Neuron repository only (the note at
# the top of requirements-neuron.txt); NEURON_PIP_INDEX mirrors platform-settings.json
# neuron_pip_index. PIP_* build args: pip's own settings (containers/gpu.Dockerfile).
ARG NEURON_PIP_INDEX=https://pip.repos.neuron.amazonaws.com
ARG PIP_INDEX_URL
ARG PIP_CERT
ARG PIP_FIND_LINKS
COPY training/requirements-neuron.txt /opt/sana/requirements.txt
RUN python3 -m venv --system-site-packages /opt/sana/venv \
    && /opt/sana/venv/bin/python -m pip install --no-cache-dir --disable-pip-version-check \
         --extra-index-url "${NEURON_PIP_INDEX}" -r /opt/sana/requirements.txt \
    && /opt/sana/venv/bin/python -m pip check

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
# The Neuron tools (neuron-ls, neuron-top) the DLC installs under /opt/aws/neuron/bin stay on PATH.
ENV PATH=/opt/sana/venv/bin:/opt/aws/neuron/bin:${PATH} \
    PYTHONPATH=/opt/sana \
    PYTHONUNBUFFERED=1
USER ${SANA_UID}

LABEL org.opencontainers.image.title="sana-neuron" \
      sana.requirements-file="training/requirements-neuron.txt"
CMD ["python", "-m", "training.trainium", "--help"]
