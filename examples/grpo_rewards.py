"""Reward functions for examples/grpo.yml, found beside the config as `grpo_rewards.<name>`.

Each is called as TRL calls them: the prompts, the completions (a chat prompt's completions are
[{"role": "assistant", "content": text}]), and the rows' other columns by name (`answer` here); each returns one
float per completion (None: not scored).
"""

import re

NUMBER = re.compile(r"-?\d+")


def _text(completion) -> str:
    return completion[0]["content"] if isinstance(completion, list) else completion


def correct(prompts, completions, answer, **kwargs):
    """1 when the first number of the reply is the sum, else 0."""
    rewards = []
    for completion, expected in zip(completions, answer):
        found = NUMBER.search(_text(completion))
        rewards.append(1.0 if found and int(found.group()) == int(expected) else 0.0)
    return rewards


def brief(prompts, completions, **kwargs):
    """The prompt asks for just the number: 1 for a reply of one word, falling to 0 at twenty words or more."""
    return [max(0.0, 1.0 - (len(_text(completion).split()) - 1) / 19) for completion in completions]
