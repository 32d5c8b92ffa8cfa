#!/usr/bin/env python3
"""Drives USERS distinct end users' tokens through a live `replyd api`, one request each, and
samples the API process's resident set as they go: each user makes one rate-limit bucket in
the process, so the figures show whether its memory grows with the users it has seen.

The tokens are minted here with the workspace's signing secret (HS256, the claims
`replyd_core::end_user::mint` writes), so the run measures the API, not token issuance. Each
request is `GET /v1/replies/%FF`: authenticated (the user's bucket is taken), then refused as
`400 invalid_path` before any other work.

Usage: bench_users.py API_URL WORKSPACE SECRET PID [users] [threads] [samples]
Prints one JSON line per sample (users so far, VmRSS, VmHWM) and a last one after waiting
for the next sweep of the buckets.
"""

import base64
import hashlib
import hmac
import http.client
import json
import sys
import threading
import time
import urllib.parse


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def mint(key: bytes, workspace: str, user: str, now: int) -> str:
    header = b64(json.dumps({"typ": "JWT", "alg": "HS256"}, separators=(",", ":")).encode())
    claims = {"iss": "replyd", "sub": user, "ws": workspace, "iat": now, "exp": now + 3600, "generation": 0}
    body = b64(json.dumps(claims, separators=(",", ":")).encode())
    signature = hmac.new(key, f"{header}.{body}".encode(), hashlib.sha256).digest()
    return f"{header}.{body}.{b64(signature)}"


def status_kib(pid: int) -> dict:
    fields = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                fields[name] = int(value.split()[0])
    return fields


def main() -> None:
    api, workspace, secret, pid = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    users = int(sys.argv[5]) if len(sys.argv) > 5 else 100_000
    threads = int(sys.argv[6]) if len(sys.argv) > 6 else 8
    samples = int(sys.argv[7]) if len(sys.argv) > 7 else 10
    key = base64.urlsafe_b64decode(secret + "=" * (-len(secret) % 4))
    target = urllib.parse.urlparse(api)
    now = int(time.time())
    started = time.monotonic()
    print(json.dumps({"users": 0, "seconds": 0, **status_kib(pid)}), flush=True)
    step = users // samples
    refused = []
    for sample in range(samples):
        lo, hi = sample * step, users if sample == samples - 1 else (sample + 1) * step

        def drive(first: int) -> None:
            connection = http.client.HTTPConnection(target.hostname, target.port)
            for n in range(lo + first, hi, threads):
                token = mint(key, workspace, f"bench-user-{n}", now)
                connection.request("GET", "/v1/replies/%FF", headers={"Authorization": f"Bearer {token}"})
                response = connection.getresponse()
                response.read()
                if response.status != 400:
                    refused.append(response.status)
            connection.close()

        workers = [threading.Thread(target=drive, args=(t,)) for t in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        print(json.dumps({"users": hi, "seconds": round(time.monotonic() - started, 1), **status_kib(pid)}), flush=True)
    if refused:
        print(json.dumps({"unexpected_statuses": sorted(set(refused)), "count": len(refused)}), flush=True)
    # One sweep interval (`api::rate_limit::SWEEP_INTERVAL`, 30 s) and a little more: the
    # buckets of every user above have filled up again and been dropped.
    time.sleep(35)
    print(json.dumps({"users": users, "after_sweep": True, "seconds": round(time.monotonic() - started, 1), **status_kib(pid)}), flush=True)


if __name__ == "__main__":
    main()
