# Two commands on a fresh machine: `make demo` and `make test`.
# Each creates .venv when missing and installs the project into it.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast bench venv mosquitto chromium clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	@touch $(STAMP)

venv: $(STAMP)

# make test needs a real mosquitto: the one on PATH, else Debian's package
# (installed with apt-get when we are root), else a clear stop.
mosquitto:
	@PATH="$$PATH:/usr/sbin" command -v mosquitto >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "mosquitto not found: installing Debian package 'mosquitto' with apt-get"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mosquitto >/dev/null; \
	  else \
	    echo "error: make test needs the MQTT broker mosquitto; install the Debian package 'mosquitto' (sudo apt-get install mosquitto)" >&2; exit 1; \
	  fi; }
	@PATH="$$PATH:/usr/sbin" command -v mosquitto >/dev/null 2>&1 || { echo "error: mosquitto still missing after apt-get" >&2; exit 1; }

# The site page test drives Debian's headless Chromium through chromedriver: installed with apt-get
# when we are root, else that one test is skipped with its reason.
chromium:
	@command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "chromium not found: installing Debian packages 'chromium' and 'chromium-driver' with apt-get"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null; \
	  else \
	    echo "warning: no headless Chromium: the site page test will be skipped (apt-get install chromium chromium-driver)" >&2; \
	  fi; }

test: $(STAMP) mosquitto chromium
	PATH="$(CURDIR)/$(BIN):$$PATH:/usr/sbin" FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 \
	  $(BIN)/python -m pytest -q tests

test-fast: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH:/usr/sbin" $(BIN)/python -m pytest -q -m "not slow" tests

demo: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH:/usr/sbin" FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 \
	  $(BIN)/fogline demo

bench: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH:/usr/sbin" $(BIN)/fogline bench all

clean:
	rm -rf $(VENV) build *.egg-info
