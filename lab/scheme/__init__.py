"""What a scheme stores, packs into and costs: ``stored`` (the rules a checkpoint is written by),
``cost`` (the bytes it takes)."""
