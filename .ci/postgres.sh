#!/usr/bin/env bash
# A PostgreSQL server on loopback for the hyperparameter search's scale-out test (tests/hpo/test_postgres.py).
# Source it from .ci/run: it exports HF_SCALE_TEST_POSTGRES_URL. It does not stop the script itself: without a server
# the test fails in CI (CI=true) and skips elsewhere, saying why. Debian's package; the cluster lives in a throw-away
# folder, port 55432, owned by `postgres`.
hf_scale_postgres() {
    local port=55432 data=/tmp/hf_scale_postgres log=/tmp/hf_scale_postgres.log password=hpo-ci-password bin
    bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1) || true
    if [ -z "$bin" ] && [ "$(id -u)" = 0 ]; then
        DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null \
            && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
        bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1) || true
    fi
    if [ -z "$bin" ] || ! id postgres >/dev/null 2>&1; then
        echo "postgres.sh: no PostgreSQL server installed; the scale-out test cannot run"
        return 0
    fi
    if [ ! -f "$data/PG_VERSION" ]; then
        rm -rf "$data" && mkdir -p "$data" && chown postgres "$data"
        printf '%s\n' "$password" > /tmp/hf_scale_postgres.pw && chown postgres /tmp/hf_scale_postgres.pw
        runuser -u postgres -- "$bin/initdb" -D "$data" -U postgres --auth=scram-sha-256 \
            --pwfile=/tmp/hf_scale_postgres.pw >/dev/null || { echo "postgres.sh: initdb failed"; return 0; }
    fi
    if ! runuser -u postgres -- "$bin/pg_ctl" -D "$data" status >/dev/null 2>&1; then
        runuser -u postgres -- "$bin/pg_ctl" -D "$data" -l "$log" -w -t 60 \
            -o "-c listen_addresses=127.0.0.1 -p $port -k /tmp" start >/dev/null \
            || { echo "postgres.sh: the server did not start, see $log"; return 0; }
    fi
    PGPASSWORD=$password psql -h 127.0.0.1 -p "$port" -U postgres -tAc \
        "SELECT 1 FROM pg_database WHERE datname = 'hpo'" | grep -q 1 \
        || PGPASSWORD=$password psql -h 127.0.0.1 -p "$port" -U postgres -qc "CREATE DATABASE hpo" \
        || { echo "postgres.sh: could not create the database"; return 0; }
    export HF_SCALE_TEST_POSTGRES_URL="postgresql://postgres:$password@127.0.0.1:$port/hpo"
    echo "postgres.sh: PostgreSQL on 127.0.0.1:$port, database hpo"
}
hf_scale_postgres
