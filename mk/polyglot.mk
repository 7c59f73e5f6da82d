# Go, Node and Java interop clients and ghz load tests (filled in by the polyglot work).
.PHONY: interop-deps
interop-deps:
	@true
