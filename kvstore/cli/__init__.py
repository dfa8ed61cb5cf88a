"""The ``kvstore`` command: the command table (commands.py), the argument helpers every parser
shares (args.py), progress and tables for long work, and the simulator's shells.

The table is the composition root of the program: it names modules of every layer as strings,
imported only when their command runs.
"""
