"""The shell bodies of the pretend node's network clients (lifecycle_cluster.py STANDINS "aws", "docker",
"curl"): what a HyperPod node's AWS CLI, Docker client and curl answer in its subnet, public or private
(``STANDIN_PRIVATE_SUBNET``). What each stands for, with its sources, is written at its STANDINS entry;
tests/lifecycle/test_private_subnet_standins.py holds the private-subnet curl against the real one."""

AWS = r"""
case "$1 $2" in
  "ecr get-login-password")
    shift 2; region=
    while [ $# -gt 0 ]; do case $1 in --region) region=$2; shift 2;; *) shift;; esac; done
    if [ "$region" != "$STANDIN_REGION" ]; then
      echo "Could not connect to the endpoint URL: \"https://api.ecr.${region:-us-east-1}.amazonaws.com/\"" >&2; exit 255; fi
    echo "standin-ecr-token-$region"; exit 0;;
  "s3 cp") shift 2;;
  *) echo "aws $1 $2: not stood in" >&2; exit 252;;
esac
region=; src=; dst=; recursive=
while [ $# -gt 0 ]; do case $1 in --region) region=$2; shift 2;; --recursive) recursive=1; shift;;
  s3://*) src=${1#s3://}; shift;; --*) shift;; *) dst=$1; shift;; esac; done
if [ "$region" != "$STANDIN_REGION" ]; then
  echo "Could not connect to the endpoint URL: \"https://s3.${region:-us-east-1}.amazonaws.com/${src%%/*}\"" >&2; exit 255; fi
if [ -n "$recursive" ]; then
  mkdir -p "$dst"; if [ -d "$STANDIN_S3/$src" ]; then cp -R "$STANDIN_S3/$src/." "$dst/"; fi; exit 0; fi
if [ ! -f "$STANDIN_S3/$src" ]; then
  echo "fatal error: An error occurred (404) when calling the HeadObject operation: Key \"${src#*/}\" does not exist" >&2
  exit 1; fi
cp "$STANDIN_S3/$src" "$dst"
"""
DOCKER = r"""
config=${DOCKER_CONFIG:-$HOME/.docker}
if [ "$1" = --config ]; then config=$2; shift 2; fi
case $1 in
  login) registry=; for a; do registry=$a; done
    token=$(cat)
    if [ -z "$token" ]; then echo "Error: Cannot perform an interactive login from a non TTY device" >&2; exit 1; fi
    mkdir -p "$config"; printf '{"auths": {"%s": {"auth": "stand-in"}}}\n' "$registry" >"$config/config.json"
    echo "Login Succeeded"; exit 0;;
  pull) ;;
  *) echo "docker $1: not stood in" >&2; exit 1;;
esac
for image; do :; done
registry=${image%%/*}
case $registry in
  *.dkr.ecr.*.amazonaws.com) ecr=1;;
  *) ecr=;;
esac
if [ -n "$STANDIN_PRIVATE_SUBNET" ]; then case $registry in *.dkr.ecr.$STANDIN_REGION.amazonaws.com) ;; *)
  echo "Error response from daemon: Get \"https://$registry/v2/\": net/http: request canceled while waiting for connection (Client.Timeout exceeded while awaiting headers)" >&2; exit 1;; esac; fi
if [ -n "$ecr" ] && ! grep -qs "\"$registry\"" "$config/config.json"; then
  rest=${image#*/}; repo=${rest%:*}; tag=${rest##*:}
  echo "Error response from daemon: Head \"https://$registry/v2/$repo/manifests/$tag\": no basic auth credentials" >&2; exit 1; fi
case " $STANDIN_DOCKER_IMAGES " in *" $image "*) echo "$image"; exit 0;; esac
echo "Error response from daemon: manifest for $image not found: manifest unknown: manifest unknown" >&2; exit 1
"""
CURL = r"""
if [ -z "$STANDIN_PRIVATE_SUBNET" ]; then exec /usr/bin/curl "$@"; fi
for a; do case $a in file://*) exec /usr/bin/curl "$@";; esac; done
timeout=300; retry=0; url=
while [ $# -gt 0 ]; do case $1 in
  --connect-timeout) timeout=$2; shift 2;; --retry) retry=$2; shift 2;;
  -o|--output|--retry-delay|--max-time|-m) shift 2;;
  http://*|https://*) url=$1; shift;; *) shift;; esac; done
host=${url#*://}; host=${host%%/*}
attempt=0
while [ "$attempt" -le "$retry" ]; do
  [ -n "$STANDIN_LOG" ] && echo "curl-attempt $url" >>"$STANDIN_LOG"
  echo "curl: (28) Failed to connect to $host port 443 after ${timeout}000 ms: Timeout was reached" >&2
  attempt=$((attempt + 1))
done
exit 28
"""
