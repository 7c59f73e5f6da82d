# nginx, for the tests that run the router behind a real gRPC proxy (tests/integration/
# test_nginx.py, test_feed_resilience.py, tests/shards), and curl, which sends the shard-map
# test's non-ASCII x-group-id headers that gRPC clients refuse. Included by the main Makefile.
#
# The Debian package is installed when `nginx` is missing (apt-get update first: a fresh
# machine has no package lists). Installing it starts the system service on Debian; the tests
# never use it (each starts its own nginx with a generated config under a temporary prefix),
# so it is stopped again rather than left listening on port 80.

NGINX_BIN := $(shell PATH="$$PATH:/usr/sbin:/sbin" command -v nginx 2>/dev/null)
CURL_BIN := $(shell command -v curl 2>/dev/null)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: nginx-deps

nginx-deps:  ## install nginx (Debian package) for the proxy tests; its system service is stopped
ifeq ($(NGINX_BIN),)
	$(SUDO) apt-get update -qq
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx >/dev/null
	@pid=$$(cat /run/nginx.pid 2>/dev/null); \
	if [ -n "$$pid" ] && kill -0 "$$pid" 2>/dev/null; then \
	  $(SUDO) /usr/sbin/nginx -s quit && echo "nginx-deps: stopped the system nginx service"; fi
	@echo "nginx-deps: installed $$(/usr/sbin/nginx -v 2>&1)"
else
	@echo "nginx-deps: $$($(NGINX_BIN) -v 2>&1) at $(NGINX_BIN)"
endif
ifeq ($(CURL_BIN),)
	$(SUDO) apt-get update -qq
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq curl >/dev/null
endif
