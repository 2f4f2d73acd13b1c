# Sourced by .ci/run and scripts/demo.sh: start each local service whose port is closed.
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
wait_port() {
  for _ in $(seq 1 60); do port_open "$1" && return 0; sleep 1; done
  echo "service on port $1 did not start" >&2; return 1
}
start_services() {
  if ! port_open 5432; then
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql)" main start; wait_port 5432
  fi
  if ! port_open 6379; then
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
      --dir /var/lib/redis --logfile /var/log/redis/ci.log
    wait_port 6379
  fi
  if ! port_open 5672; then
    rabbitmq-server -detached; wait_port 5672
  fi
  if ! port_open 4222 && [ -x /usr/sbin/nats-server ]; then  # NATS with JetStream (Debian: nats-server)
    mkdir -p /var/lib/nats-server
    start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- \
      -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log
    wait_port 4222
  fi
}
