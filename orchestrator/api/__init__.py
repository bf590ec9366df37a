"""The gRPC surface: ChatService, its handlers and the conversions between protos and stored models."""
