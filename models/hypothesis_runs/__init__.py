"""How Hypothesis runs are made reproducible and bounded.

``reproducible`` (derandomized runs that draw the same inputs in every process) and
``shrink_budget`` (bounded shrinking, Hypothesis' own messages kept off stdout).
"""
