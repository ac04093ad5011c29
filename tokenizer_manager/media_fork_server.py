"""The last module the media fork server imports (cpu_pool.MEDIA_WORKER_PRELOAD), after the
media code: it freezes every object imported so far into the collector's permanent generation.
A worker forked from the server then shares those pages with it (a collection in the worker
would touch, and so copy, every one of them), and the server's own exit skips a full
collection over them (1.7 s of its 3 s exit on the 2-core machine)."""

from runtime.allocator import freeze_startup_objects

freeze_startup_objects()
