"""The synthetic arithmetic task's structure, below the credit layer: its grammar (the reference
order of operations, a response's steps checked against it, counterfactual edits:
:mod:`oar.task.grammar`) and the parsing of a response's tokens into the characters the grammar
names (steps, results, the boxed answer: :mod:`oar.task.parsing`). The credit estimators that read
a task's ground truth (the oracle controls, OAR-P's tied perturbation, ``mc_value``'s step splitter)
and the attribution benchmark both import it."""
