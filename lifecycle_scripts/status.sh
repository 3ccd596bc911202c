# shellcheck shell=bash
# The node's status file on FSx ($FSX/logs/provision/<instance>.status), what an operator lists
# (`cat /fsx/logs/provision/*.status`) and the smoke job reads (training/smoke/parse.py):
#   line 1  <time> READY|PENDING node=<n> group=<g> role=<r> ip=<ip> package=<h> <key=value ...> [cause=<text>]
#   then    <time> WARN node=<n> part=<step> cause=<text>     one per optional part that does not work
# PENDING: the lifecycle finished (the node is usable) and the late check, sana-node-ready.service
# (slurm_ready.sh), has not yet seen this node's part of Slurm up. READY: it has. A FAILED line
# is on_init_complete.sh's fail(), alone in the file.

# record_node_status VERDICT DETAILS: the verdict line, then the lifecycle's and the late
# check's WARN lines, written whole by root (common.sh write_node_status: never through a link),
# under a node-local lock (the ready step and the late check can run at the same moment).
record_node_status() {
  local verdict=$1 details=$2 now content
  now=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  content=$(
    printf '%s %s node=%s group=%s role=%s ip=%s package=%s %s\n' "$now" "$verdict" "$NODE_NAME" \
      "$NODE_GROUP" "$NODE_ROLE" "$NODE_IP" "$CFG_PACKAGE_HASH" "$details"
    local warnings part cause
    for warnings in "$WARNINGS_FILE" "$LATE_WARNINGS_FILE"; do
      [[ -r $warnings ]] || continue
      while IFS=$'\t' read -r part cause; do
        [[ -z $part ]] || printf '%s WARN node=%s part=%s cause=%s\n' "$now" "$NODE_NAME" "$part" "$cause"
      done <"$warnings"
    done
  )
  (
    flock -w 60 7 || die "timed out after 60s waiting for $STATE_DIR/status.lock"
    write_node_status "$content"
  ) 7>>"$STATE_DIR/status.lock"
}
