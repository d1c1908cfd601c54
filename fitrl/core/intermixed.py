"""A command line's options and positionals in any order (``fitrl plan CONFIG --no-recommend
key=value``), for every subcommand of fitrl/cli.py."""

from __future__ import annotations

import argparse


class IntermixedParser(argparse.ArgumentParser):
    """A subcommand's parser that takes its options and positionals in any order
    (``fitrl plan CONFIG --no-recommend actor.micro_batch_size=2``): argparse's own parse stops
    filling ``overrides`` at the first option and calls what follows unrecognised. A parser with
    subcommands of its own (``fitrl checkpoint``), which intermixed parsing refuses, parses as usual."""

    _intermixing = False

    def parse_known_args(self, args=None, namespace=None):
        nested = any(a.nargs in (argparse.PARSER, argparse.REMAINDER) for a in self._get_positional_actions())
        if self._intermixing or nested:  # (parse_known_intermixed_args calls back here for each half)
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False
