"""One logging set-up for every tessera process; rank-0-only helpers for TP processes."""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s [%(processName)s] %(name)s: %(message)s"


def configure_logging(level: str = "info", prefix: str = "") -> None:
    fmt = FORMAT if not prefix else FORMAT.replace("%(processName)s", prefix)
    logging.basicConfig(level=level.upper(), format=fmt, force=True)


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


def log_rank0(logger: logging.Logger, rank: int, msg: str, *args: object) -> None:
    if rank == 0:
        logger.info(msg, *args)
