#!/bin/bash
# device job: the abort_safety set into $RES, then the JIT cache (unless NOSAVE=1)
SHA=$1; RES=${RES:-/tmp/res}
rm -rf /tmp/ck $RES && mkdir -p /tmp/ck $RES && cp -r bench harness src tests pyproject.toml /tmp/ck/ && cd /tmp/ck
. /tmp/dsv4-bundle/root/env.sh
export PYTHONPATH=/tmp/ck/src:$PYTHONPATH PYTHONUNBUFFERED=1 COMMIT=$SHA
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > $RES/smi.txt 2>&1
date -u +%FT%TZ > $RES/started
timeout -s TERM ${BOUND:-1500} python3 -m bench.gpu_server run abort_safety --commit $SHA --startup-timeout ${STARTUP:-900} \
  --mem-fraction ${MEMF:-0.7} --out $RES/abort_safety.json > $RES/run.out 2>&1
echo "run rc=$?" >> $RES/run.out
touch $RES/RUN_DONE
[ "${NOSAVE:-0}" = 1 ] || python3 -m bench.airgap cache save --out $RES/jit > $RES/cache_save.out 2>&1
touch $RES/DONE
