#!/usr/bin/env bash
# Make a private CA and a Redis server certificate in DIR (ops/cluster.yaml's head node runs it once).
# Replace with your organisation's CA when you have one; the key never leaves the head node.
set -euo pipefail
dir=${1:?usage: redis-tls-cert.sh DIR}
mkdir -p "$dir" && cd "$dir"
openssl genrsa -out ca.key 4096
openssl req -x509 -new -nodes -key ca.key -sha256 -days 3650 -subj "/CN=adaptive-eagle-redis-ca" -out ca.crt
openssl genrsa -out redis.key 2048
openssl req -new -key redis.key -subj "/CN=adaptive-eagle-redis" -out redis.csr
openssl x509 -req -in redis.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 825 -sha256 -out redis.crt
chmod 600 ca.key redis.key
cp ca.crt /mnt/efs/adaptive-eagle/redis-ca.crt 2>/dev/null || true  # workers verify the server with it
