"""Generated protobuf and gRPC code for the `tlt.v1` wire protocol.

Never edit the `*_pb2*.py` files by hand: change `proto/tlt/v1/*.proto` and
run `python -m tlt.protogen` (the build does it).
"""
