"""Budgeted allocation (issue 34): each layer's format and observer chosen under a size budget by
the model's own loss. ``schemes`` reads the candidates and budgets; ``cost`` says what a layer takes
in the packed checkpoint under a scheme, the budget's unit (the layers that must share a scheme are
``lab.runtime.fusion``'s); ``held_out`` splits the held-out text in two parts; ``score`` scores every
(layer, scheme, observer) on the scoring part; ``solve`` picks one option per group within a budget,
exactly; ``frontier`` solves every budget and measures it on the measuring part (and in sample);
``export`` writes the allocation as a choice; ``command`` and ``session`` are the CLI and the page."""
