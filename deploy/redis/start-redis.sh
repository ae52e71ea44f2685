#!/bin/sh
# Start Redis for docker-compose.yml (or a node of docker-compose.cluster.yml, with
# RLBUS_REDIS_CLUSTER=yes) with the ACL users of users.acl:
#   sh start-redis.sh REDIS-SERVER-COMMAND... (e.g. docker-entrypoint.sh redis-server)
# Passwords come from RLBUS_{ADMIN,TRAINER,ROLLOUTER,PROFILER,LOGGER,OPERATOR}_PASSWORD and
# are written only as SHA-256 hashes, to a file outside the data volume; RLBUS_RUN_ID names
# the one run whose keys the component users may touch (default demo).
set -eu
here=$(dirname "$0")
run=${RLBUS_RUN_ID:-demo}
case "$run" in
  "" | *[!A-Za-z0-9_.-]*) echo "start-redis: RLBUS_RUN_ID must be letters, digits, _ . -" >&2
                          exit 2 ;;
esac
hash() {
  eval "value=\${$1:-}"
  if [ -z "$value" ]; then echo "start-redis: set $1 (a password)" >&2; exit 2; fi
  printf %s "$value" | sha256sum | cut -d' ' -f1
}
admin=$(hash RLBUS_ADMIN_PASSWORD)
trainer=$(hash RLBUS_TRAINER_PASSWORD)
rollouter=$(hash RLBUS_ROLLOUTER_PASSWORD)
profiler=$(hash RLBUS_PROFILER_PASSWORD)
logger=$(hash RLBUS_LOGGER_PASSWORD)
operator=$(hash RLBUS_OPERATOR_PASSWORD)
acl=${RLBUS_ACL_OUT:-/tmp/rlbus-users.acl}
umask 077
sed -e '/^#/d' -e "s/@RUN@/$run/g" -e "s/@ADMIN_HASH@/$admin/" -e "s/@TRAINER_HASH@/$trainer/" \
    -e "s/@ROLLOUTER_HASH@/$rollouter/" -e "s/@PROFILER_HASH@/$profiler/" \
    -e "s/@LOGGER_HASH@/$logger/" -e "s/@OPERATOR_HASH@/$operator/" \
    "$here/users.acl" > "$acl"
# The image's entrypoint runs the server as user redis: it must be able to read the file.
chown redis "$acl" 2>/dev/null || true
if [ "${RLBUS_REDIS_CLUSTER:-no}" = yes ]; then
  # A node of docker-compose.cluster.yml: its identity in the data volume (a restarted node
  # rejoins as itself), and a replica syncs from its master as admin. Redis rewrites its
  # process title at start, so the password does not stay visible in ps.
  set -- "$@" --cluster-enabled yes --cluster-config-file nodes.conf \
    --masteruser admin --masterauth "$RLBUS_ADMIN_PASSWORD"
fi
exec "$@" --aclfile "$acl" --appendonly yes --appendfsync everysec \
  --maxmemory-policy noeviction --save ""
