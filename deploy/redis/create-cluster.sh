#!/bin/sh
# Form the Redis Cluster of docker-compose.cluster.yml, once:
#   sh create-cluster.sh HOST:PORT...   (masters first, then their replicas: redis-cli's order)
# RLBUS_CLUSTER_REPLICAS replicas per master (default 1). Runs as the admin user
# (RLBUS_ADMIN_PASSWORD, passed to redis-cli in the environment, never on its command line).
# A cluster that is already formed (a second `docker compose up`) is left as it is.
set -eu
: "${RLBUS_ADMIN_PASSWORD:?create-cluster: set RLBUS_ADMIN_PASSWORD}"
export REDISCLI_AUTH="$RLBUS_ADMIN_PASSWORD"
cli=${REDIS_CLI:-redis-cli}
replicas=${RLBUS_CLUSTER_REPLICAS:-1}
tries=${RLBUS_CLUSTER_WAIT_S:-60}
[ "$#" -gt 0 ] || { echo "create-cluster: name the nodes as HOST:PORT" >&2; exit 2; }
ask() {  # ask HOST:PORT COMMAND... as admin
  node=$1; shift
  "$cli" -h "${node%:*}" -p "${node##*:}" --user admin --no-auth-warning "$@"
}
addresses=""
for node in "$@"; do
  i=0
  until [ "$(ask "$node" ping 2>/dev/null)" = PONG ]; do
    i=$((i + 1))
    if [ "$i" -gt "$tries" ]; then
      echo "create-cluster: $node did not answer PING as admin within $tries s" >&2; exit 1
    fi
    sleep 1
  done
  # redis-cli --cluster wants addresses: a compose service name is resolved here.
  host=${node%:*}
  ip=$(getent hosts "$host" | awk '{ print $1; exit }')
  addresses="$addresses ${ip:-$host}:${node##*:}"
done
if ask "$1" cluster info | grep -q '^cluster_state:ok'; then
  echo "create-cluster: the cluster is already formed"
  exit 0
fi
# shellcheck disable=SC2086  # one word per address
ask "$1" --cluster create $addresses --cluster-replicas "$replicas" --cluster-yes
i=0
for node in "$@"; do
  until ask "$node" cluster info | grep -q '^cluster_state:ok'; do
    i=$((i + 1))
    if [ "$i" -gt "$tries" ]; then
      echo "create-cluster: $node did not reach cluster_state:ok within $tries s" >&2; exit 1
    fi
    sleep 1
  done
done
echo "create-cluster: $# nodes, $replicas replica(s) per master, cluster_state:ok"
