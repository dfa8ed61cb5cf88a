"""The node process: its gRPC, local and UCX faces over one read routine, the store holder, the
repair service, delete-log sync with peers, map following and metrics.
"""
