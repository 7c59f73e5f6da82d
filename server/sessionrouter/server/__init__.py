"""The sessionrouter service: a grpc.aio server over a transport-free core."""
