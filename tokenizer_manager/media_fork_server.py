"""The last module the media fork server imports (cpu_pool.MEDIA_WORKER_PRELOAD), after the
media code: there it freezes every object imported so far into the collector's permanent
generation. A worker forked from the server then shares those pages with it (a collection in
the worker would touch, and so copy, every one of them), and the server's own exit skips a full
collection over them (1.7 s of its 3 s exit on the 2-core machine). Imported by any other
process it does nothing."""

import os

from runtime.allocator import freeze_startup_objects
from tokenizer_manager.cpu_pool import FORK_SERVER_ENV

if os.environ.get(FORK_SERVER_ENV) == "1":
    freeze_startup_objects()
