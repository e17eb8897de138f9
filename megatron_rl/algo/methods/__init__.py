"""Token-weight methods: what stops low-probability tokens from dominating the gradient.

The gradient of a token's loss with respect to the logits scales with ``1 - p``, so rare
tokens pull hardest. Each method is one file holding its config section, its math and its
registration: ``ar`` (Advantage Reweighting), ``lopti`` (Low-Probability Token
Isolation), ``stapo`` (spurious-token masking), ``tr_grpo`` (probability-increasing token
weights). ``base`` says what a method may do (its hooks); ``compose`` combines the
enabled ones for the actor and the policy loss, which never name a method.

A new method: a file here with a ``config_class`` section, a ``TokenWeightMethod``
subclass decorated with ``register_method``, and its section added to
``algo.config.AlgorithmConfig`` (whose imports fix the composition order). A method
registered at run time whose name is no field of ``AlgorithmConfig`` gets the whole
``algorithm`` section instead. This ``__init__`` imports nothing, so the method files
import ``base`` without a cycle.
"""
