"""Magics. Rank-side ones run inside every rank's shell (``rank_side.register``); front-side ones are
handled by the kernel before a cell is dispatched (``front_side``)."""
