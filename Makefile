# The one list of commands. The README shows the two that matter (make demo, make test);
# .ci/run calls `make test`.

CARGO ?= cargo

.PHONY: build test build-tests tests infra-up-chaos infra-down-chaos lint unit client-test test-tools infra-up infra-down infra-clean infra-status demo bench bench-recovery bench-duplicates bench-api bench-quota bench-check bench-users bench-capacity bench-sqs bench-live bench-kills bench-triggers bench-idle bench-fairness chaos fuzz image

build:
	$(CARGO) build --release

## image: the container image, tagged with the crate's version and naming the commit it was
## built from (`replyd --version`, the image's revision label). Needs a container engine
## (docker, or podman with IMAGE_TOOL=podman); push it and pin it by digest (docs/DEPLOY.md).
IMAGE_TOOL ?= docker
IMAGE ?= replyd
VERSION = $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
image:
	$(IMAGE_TOOL) build -f deploy/Dockerfile --build-arg VERSION=$(VERSION) \
		--build-arg REPLYD_COMMIT=$$(git rev-parse --short=12 HEAD) -t $(IMAGE):$(VERSION) .

## test: start the local infrastructure, install the tools only the tests use, check format
## and lints, run every test (the workspace's: the tools' own test makes cargo build
## replyd-lab, which some tests run). Each stage is timed into $$REPLYD_STAGES when it is set
## (`.ci/run` prints them).
STAGE = bash .ci/stage
test:
	$(STAGE) infra-up $(MAKE) --no-print-directory infra-up infra-up-chaos
	$(STAGE) test-tools $(MAKE) --no-print-directory test-tools
	$(STAGE) lint $(MAKE) --no-print-directory lint
	$(STAGE) client-test $(MAKE) --no-print-directory client-test
	$(STAGE) build $(MAKE) --no-print-directory build-tests
	$(STAGE) tests $(MAKE) --no-print-directory tests
	$(STAGE) doc-tests $(CARGO) test --workspace --doc

## build-tests: every test binary, the chaos scenarios' too (`--all-targets` leaves them out,
## and a `--test` beside it is ignored).
build-tests:
	$(CARGO) test --workspace --all-targets --no-run
	$(CARGO) test --test chaos --no-run

## tests: every test, the chaos scenarios (`test = false`: `--all-targets` leaves them out)
## beside the rest, on a set of services of their own: they crash PostgreSQL, the broker and
## ElasticMQ, which the other tests use. Their output follows the rest's, whole.
CHAOS_INFRA = $(CURDIR)/target/infra-chaos
tests:
	@mkdir -p target; REPLYD_INFRA_DIR=$(CHAOS_INFRA) $(CARGO) test --test chaos > target/chaos-tests.log 2>&1 & chaos=$$!; \
	$(CARGO) test --workspace --all-targets --no-fail-fast; rest=$$?; \
	wait $$chaos; scenarios=$$?; \
	echo "---- the chaos scenarios (target/chaos-tests.log) ----"; cat target/chaos-tests.log; \
	[ $$rest -eq 0 ] && [ $$scenarios -eq 0 ]

## infra-up-chaos, infra-down-chaos: the chaos scenarios' own services (target/infra-chaos).
infra-up-chaos:
	REPLYD_INFRA_DIR=$(CHAOS_INFRA) bash deploy/infra.sh up
infra-down-chaos:
	REPLYD_INFRA_DIR=$(CHAOS_INFRA) bash deploy/infra.sh down

## lint: formatting, clippy (warnings denied), and the doc comments' links to items (a
## renamed or removed name fails).
lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy --test chaos -- -D warnings
	RUSTDOCFLAGS="-D warnings -A rustdoc::private_intra_doc_links" $(CARGO) doc --quiet --no-deps --document-private-items -p replyd -p replyd-core -p replyd-lab

## client-test: the TypeScript client (clients/typescript): its packages, its committed build
## output against its sources and docs/openapi.json, its unit tests, and the browser tests'
## build (tests/it/browser.rs runs them).
client-test:
	cd clients/typescript && npm ci --no-audit --no-fund --prefer-offline && npm run check && npm test

## unit: the tests that need no infrastructure.
unit:
	$(CARGO) test --workspace --lib

infra-up:
	bash deploy/infra.sh up

## test-tools: what only the tests run (schemathesis, promtool, helm, Jaeger, the image and
## chart checkers, Node.js and Chromium), built or installed once per machine.
test-tools:
	bash deploy/infra.sh tools

infra-down:
	bash deploy/infra.sh down
	REPLYD_INFRA_DIR=$(CHAOS_INFRA) bash deploy/infra.sh down

infra-clean:
	bash deploy/infra.sh clean
	REPLYD_INFRA_DIR=$(CHAOS_INFRA) bash deploy/infra.sh clean

infra-status:
	bash deploy/infra.sh status

## demo: the whole chain end to end on local, throwaway infrastructure: simulated browsers
## over HTTP, the API, the relay and two workers as separate processes (see deploy/demo.sh).
demo:
	bash deploy/demo.sh

## bench: docs/BENCHMARKS.md, three runs a point: P1 Little's law (one worker, mock at 1 s on
## one partition and on six, and at 200 ms, windows 1 to 1,024), P2 the PostgreSQL ceiling
## (zero-latency mock beside pgbench, unbatched and batched), P4 memory (backlogs of 10k,
## 100k, 1M), P5 failover (a worker of three SIGKILLed, both group protocols), P6 press to
## completed over SSE; then target/bench/summary.json and the plots in docs/bench/. About an
## hour.
bench:
	mkdir -p target/bench && rm -f target/bench/window.jsonl target/bench/ceiling.jsonl target/bench/memory.jsonl target/bench/failover.jsonl target/bench/front.jsonl target/bench/front-latencies.jsonl target/bench/profile.jsonl
	bash deploy/bench-window.sh 1000 1 3 1 16 64 256 1024
	bash deploy/bench-window.sh 1000 6 3 1 16 64 256 1024
	bash deploy/bench-window.sh 200 1 3 1 16 64 256 1024
	BENCH_BATCH=false bash deploy/bench-ceiling.sh 20000 256 6 3 20
	BENCH_BATCH=true bash deploy/bench-ceiling.sh 20000 256 6 3 20
	bash deploy/bench-memory.sh 45 3 10000 100000 1000000
	bash deploy/bench-failover.sh 3 classic consumer
	bash deploy/bench-front.sh 200 300 16 3
	bash deploy/bench-profile.sh 1000 5000 3 20000
	bash deploy/bench-summary.sh

## bench-recovery: 1,000 tasks, 20% of calls dropped after the work: calls per task, recovery on/off.
bench-recovery:
	bash deploy/bench-recovery.sh 1000 0.2

## bench-duplicates: 300 tasks published 3 times, two workers: the commit lag after the last
## task finished (a duplicate parked on a lease is woken when its task is done).
bench-duplicates:
	bash deploy/bench-duplicates.sh 300 3

## bench-api: POST /v1/replies at 64 connections (wrk) beside pgbench running the intake
## transaction, replays of one key, and the front half's end-to-end overhead.
bench-api:
	bash deploy/bench-api.sh 64 20

## bench-quota: 1,000 presses against a limit of 800, 20% lost answers, 20% ambiguous provider
## faults: admitted, 429s, charged, released, reconciled, unsettled, double charges.
bench-quota:
	bash deploy/bench-quota.sh 1000 800

## bench-users: 100,000 distinct end users' tokens against one API: its resident set as they
## come, and after the rate limit's buckets are swept.
bench-users:
	bash deploy/bench-users.sh 100000 8

## bench-check: replyd check's peak memory and time over 10k, 100k and 1M tasks and records.
bench-check:
	bash deploy/bench-check.sh 10000 100000 1000000

## bench-capacity: 2,000 tasks at once, two workers, against a mock limited like a hosted API
## (3,000 RPM, 64 at once): completed, failed, replies/s against the limit, refusals.
## VARIANT=tpm adds a token limit and prompts of mixed sizes; VARIANT=adaptive ignores
## WORKER_TOML (worker settings under test, or WORKER_TOML_FILE); VARIANT=retry-after is
## adaptive against a provider that reports no limit, only a refusal's Retry-After (Azure).
VARIANT ?= plain
bench-capacity:
	bash deploy/bench-capacity.sh $(VARIANT) 2000

## bench-sqs: one worker draining 3,000 tasks from SQS (ElasticMQ) and from Kafka at the same
## window (64) and mock (100 ms a call): replies/s of each and SQS ÷ Kafka, three runs.
bench-sqs:
	bash deploy/bench-sqs.sh 3000 64 100 3

## bench-kills: recovery after kills: 1,000 tasks of 500 ms, 64 at once, a worker SIGKILLed
## and started again three times; the last reply against its ideal, and generations per task.
bench-kills:
	bash deploy/bench-kills.sh 1000 3 3

## bench-fairness: a small workspace behind a big one's burst (I10): workspace A publishes
## 2,000 tasks, B 20 three seconds later, against a mock limited to 50 requests/s and 64 at
## once (declared): each workspace's publish → completed, throughput against the limit; then
## 10 workspaces with skewed backlogs: Jain's index while all are backlogged; then 3
## workspaces, one of weight 3: Jain's index of the calls each got for its weight.
bench-fairness:
	bash deploy/bench-fairness.sh burst
	bash deploy/bench-fairness.sh skewed
	bash deploy/bench-fairness.sh weighted

## bench-triggers: what each trigger of the schema costs the worker's two calls (pgbench with
## PostgreSQL timing every PL/pgSQL function), three rounds of 8 s.
bench-triggers:
	bash deploy/bench-triggers.sh 8 3

## bench-idle: what an idle worker costs (nothing to read, 60 s, three runs): its share of a
## core, and each of its threads'.
bench-idle:
	bash deploy/bench-idle.sh 60 3

## bench-live: P8, live replies: 200 presses of 1,200-character replies (300 ms to the first
## token, then about 2 s of text), 8 at once, live text on (every 75 ms) and off, three runs:
## press → first text and → completed, statements, transactions, notifications, pieces and
## CPU per reply, on ÷ off.
bench-live:
	bash deploy/bench-live.sh 1200 200 8 3

## chaos: every fault scenario for CHAOS_SECONDS (default 180) each, or one: make chaos SCENARIO=kill.
## Reports in target/chaos/<scenario>.json and target/chaos/summary.json. (make test runs a
## 20-second version of each.)
CHAOS_SECONDS ?= 180
chaos: infra-up
	CHAOS_SECONDS=$(CHAOS_SECONDS) SCENARIO=$(SCENARIO) $(CARGO) test --release --test chaos -- --test-threads=1 --nocapture

## fuzz: the record decoder under libFuzzer (needs the nightly toolchain; installs cargo-fuzz).
FUZZ_SECONDS ?= 60
fuzz:
	command -v cargo-fuzz >/dev/null || $(CARGO) install cargo-fuzz --locked
	cd fuzz && $(CARGO) +nightly fuzz run decode_record -- -max_total_time=$(FUZZ_SECONDS)
