#!/usr/bin/env bash
# The secrets compose.yaml reads, made once: the cluster token, Redis's password,
# the API keys the frontend accepts (one per line) and the one Prometheus uses.
# Existing files are kept.  The folder is private to you; the files inside must
# stay readable to the containers' own users (compose bind-mounts them as they are).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p secrets
chmod 700 secrets
new() { python3 -c "import secrets; print('$1' + secrets.token_urlsafe(32))"; }
make() {  # file, prefix
    if [ ! -s "secrets/$1" ]; then new "$2" > "secrets/$1"; chmod 644 "secrets/$1"; fi
}
make cluster_token ""
make redis_password ""
make metrics_key "sk-metrics-"
if [ ! -s secrets/api_keys ]; then
    { new "sk-"; cat secrets/metrics_key; } > secrets/api_keys
    chmod 644 secrets/api_keys
fi
echo "secrets/ is ready.  An API key for your clients: $(head -n 1 secrets/api_keys)"
