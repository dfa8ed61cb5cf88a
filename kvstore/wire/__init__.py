"""What crosses between a client and a node on the data plane, shared by both ends: the frames of
the local and UCX read channels, the UCX worker, and a batch read's answer. No store and no
node code here: ``import client`` loads this room, never kvstore.store or kvstore.node.
"""
