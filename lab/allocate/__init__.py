"""Budgeted allocation (issue 34): each layer's format and observer chosen under a size budget by
the model's own loss. ``cost`` says what a layer's weight takes in the packed checkpoint under a
scheme, the budget's unit; ``fusion`` which layers must share a scheme; ``solve`` picks one option
per group within a budget, exactly. (The scoring, the CLI and the page come next.)"""
