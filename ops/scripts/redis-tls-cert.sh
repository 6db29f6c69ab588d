#!/usr/bin/env bash
# Make a private CA and a Redis server certificate in DIR (ops/cluster.yaml's head node runs it once).
#   redis-tls-cert.sh DIR [NAME ...]
# Each NAME (a host name or an IP address) goes into the certificate's subjectAltName: clients check the
# host they connect to against it (redis-py >= 6 checks host names by default, and a certificate without
# subjectAltName matches nothing). Default names: localhost, 127.0.0.1, this host's name and its addresses.
# Replace with your organisation's CA when you have one; the keys never leave the head node.
set -euo pipefail
dir=${1:?usage: redis-tls-cert.sh DIR [NAME ...]}
shift
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  names=(localhost 127.0.0.1 "$(hostname)")
  for ip in $(hostname -I 2>/dev/null || true); do names+=("$ip"); done
fi
san=""
for n in "${names[@]}"; do
  if [[ $n =~ ^[0-9.]+$ || $n == *:* ]]; then entry="IP:$n"; else entry="DNS:$n"; fi
  case ",$san," in *",$entry,"*) ;; *) san="${san:+$san,}$entry" ;; esac
done
mkdir -p "$dir" && cd "$dir"
openssl genrsa -out ca.key 4096 2>/dev/null
openssl req -x509 -new -nodes -key ca.key -sha256 -days 3650 -subj "/CN=adaptive-eagle-redis-ca" -out ca.crt
openssl genrsa -out redis.key 2048 2>/dev/null
openssl req -new -key redis.key -subj "/CN=adaptive-eagle-redis" -out redis.csr
printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\n' "$san" > redis.ext
openssl x509 -req -in redis.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 825 -sha256 -extfile redis.ext \
  -out redis.crt 2>/dev/null
chmod 600 ca.key redis.key
echo "redis-tls-cert: $dir/redis.crt for $san"
cp ca.crt /mnt/efs/adaptive-eagle/redis-ca.crt 2>/dev/null || true  # workers verify the server with it
