"""The Envoy ext_proc gRPC service: request parsing, replies, health."""
