"""The RL loop and what drives it: building a run, checking it first, and the step.

Owns: ``builder`` (the one module that maps a whole ``RunConfig`` onto components),
``preflight`` (every check that can fail before a process starts; ``--dry-run``),
``trainer`` (the synchronous loop, top to bottom), ``pipeline`` (rollout ahead of the
update and early submission: the schedule a one-step-off run is given), ``experience``
(prompts + completions -> the actor's padded batch), ``evaluate`` (eval accuracy),
``warm`` (actor ranks and engines one driver process hands from run to run).

May import every library package (``actor``, ``rollout``, ``weight_sync``, ``cluster``,
``rewards``, ``tasks``, ``data``, ``observability``, ``config``, ``algo``); only the
command line (``cli``) imports it.
"""
