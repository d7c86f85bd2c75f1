"""Dataflow over the blocks of one scope: sites, axes, producers and chains."""
