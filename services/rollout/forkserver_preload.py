"""Imported only by the replicas' forkserver (replica_start.PRELOAD, first): it ignores SIGINT and SIGTERM.

The forkserver shares the front's process group, so Ctrl-C in a terminal or `tlt run` stopping the service
(SIGTERM to the group) reached it too. Killed, it takes its children's exit statuses with it: multiprocessing
then reports every forked replica as exited (code 255) while it still runs, so the front neither waited for
the replicas' own stop nor could kill a hung one; killed while it imported torch, the front's first replica
start failed with EOFError. It ends when the front does (the pipe it watches closes), and a replica ignores
both signals anyway (replica.serve_replica), so the forkserver's children inherit nothing they would not set.
"""

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
