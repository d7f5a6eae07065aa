"""What every data-plane stage shares and no stage owns: the error hierarchy and its envelope, the HTTP edge
middleware, and the idempotency ledger. Proxy, memory and context import from here; none imports another stage."""
