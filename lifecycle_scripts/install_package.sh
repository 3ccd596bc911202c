#!/usr/bin/env bash
# Step "package": install the training package the stack bundled next to these scripts
# (./training/) at $FSX/platform/<package_hash>/training, these lifecycle scripts with their
# platform-settings.json at $FSX/platform/<package_hash>/lifecycle (rollout.sh and
# training/slurm/rollout.sbatch run them from there). Each version is copied to a temp dir and
# renamed into place, so a directory named by a hash is always complete.
#
# $FSX/platform/current is pointed at it only when the cluster has no current package yet (its
# first boot). Afterwards only a rollout moves it (rollout.sh, runbooks/rollout.md): a node
# HyperPod creates after a `cdk deploy` (a replacement, a scale-up) boots with the newest
# prefix, installs it beside the others and serves the package every other node serves, so one
# replaced node never switches the jobs of the whole cluster to code nobody rolled out.
set -euo pipefail
# shellcheck source=SCRIPTDIR/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
step_init
require_vars FSX CFG_PACKAGE_HASH LIFECYCLE_DIR

source_dir="$LIFECYCLE_DIR/training"
# Run from an installed package ($FSX/platform/<hash>/lifecycle/, a re-run by hand or after a
# rollout): the package is the sibling directory.
if [[ ! -f $source_dir/__init__.py && -f $LIFECYCLE_DIR/../training/__init__.py ]]; then
  source_dir=$(cd "$LIFECYCLE_DIR/../training" && pwd)
fi
platform_dir="$FSX/platform"
dest="$platform_dir/$CFG_PACKAGE_HASH"

[[ -f $source_dir/__init__.py ]] \
  || die "no training package at $source_dir; the stack uploads it as training/ next to on_init_complete.sh"

if [[ -d $dest ]]; then
  log "package $CFG_PACKAGE_HASH already installed at $dest"
else
  incoming=$(mktemp -d "$platform_dir/.incoming-$CFG_PACKAGE_HASH.XXXXXX")
  cp -R "$source_dir" "$incoming/training"
  mkdir "$incoming/lifecycle"
  cp "$LIFECYCLE_DIR"/*.sh "$LIFECYCLE_DIR"/*.py "$LIFECYCLE_DIR/platform-settings.json" "$incoming/lifecycle/"
  chmod -R u+rwX,go+rX,go-w "$incoming"
  # rename(2) fails if another node renamed its copy first; theirs is as good as ours.
  if mv -T "$incoming" "$dest" 2>/dev/null; then
    log "installed package $CFG_PACKAGE_HASH at $dest"
  else
    rm -rf "$incoming"
    [[ -d $dest ]] || die "cannot move the package into $dest"
    log "package $CFG_PACKAGE_HASH was installed by another node meanwhile"
  fi
fi

current="$platform_dir/current"
if [[ -L $current && -e $current ]]; then
  serving=$(readlink "$current")
  if [[ $serving == "$CFG_PACKAGE_HASH" ]]; then
    log "$current -> $serving (this node's package)"
  else
    log "$current -> $serving stays: only a rollout moves it (runbooks/rollout.md); this node's package $CFG_PACKAGE_HASH waits beside it"
  fi
else
  # The cluster's first package (or a link left pointing at a removed directory).
  point_link "$current" "$CFG_PACKAGE_HASH"
  log "$current -> $CFG_PACKAGE_HASH (the cluster had no current package)"
fi
