"""Well-known raw dataset layouts as chat records (the forms `treepack.chat.conversations` reads), so that
``treepack tokenize`` / ``stats --tokenizer`` take them as they are published:

- ToolBench DFSDT answer trees (``G*_answer/*.json``, ``{"answer_generation", "tree", ...}``): every
  root-to-leaf path of the search tree is one conversation (system prompt and query from
  ``answer_generation.train_messages``, tool schemas from ``answer_generation.function``). A Thought node is
  assistant text, Action + Action Input an OpenAI tool call, the node's observation the tool result; all
  paths of a file share one ``tree_id``, so paths that branch share their prefix.
- Anthropic hh-rlhf (``{"chosen", "rejected"}`` as ``\\n\\nHuman: ... \\n\\nAssistant: ...`` text): a TRL
  preference record, the dialogue before the last assistant reply as ``prompt`` messages when both sides
  share it (else the implicit-prompt form).
- GSM8K model solutions (``{"question", "ground_truth", "<model>": {"solution", "is_correct"}, ...}``): one
  prompt/completion record per model, ``reward`` = ``is_correct``, one ``tree_id`` per question (a GRPO-like
  group).

Each function takes one parsed record and returns chat records (dicts); nothing here reads files.
"""

from __future__ import annotations

import re

_TURN = re.compile(r"\n\n(Human|Assistant): ")


def is_toolbench_answer(rec: dict) -> bool:
    return isinstance(rec.get("answer_generation"), dict) and isinstance(rec.get("tree"), dict)


def toolbench_paths(rec: dict, tree_id: str) -> list[dict]:
    """One ``messages`` record per root-to-leaf path of a ToolBench answer tree ([] without train_messages:
    no system prompt and query to render). Ids are ``<tree_id>/path<k>``."""
    gen = rec["answer_generation"]
    train = gen.get("train_messages") or []
    if not train or not isinstance(train[0], list) or len(train[0]) < 2:
        return []
    head = [{"role": m["role"], "content": m["content"]} for m in train[0][:2]]
    tools = [{"type": "function", "function": f} for f in gen.get("function", [])]
    out: list[dict] = []

    def emit(messages: list[dict]) -> None:
        if any(m["role"] == "assistant" for m in messages):
            out.append({"id": f"{tree_id}/path{len(out)}", "tree_id": tree_id, "messages": head + messages,
                        "tools": tools})

    def walk(node: dict, messages: list[dict], thought: str | None, action: str | None) -> None:
        kind, text = node.get("node_type"), node.get("description") or ""
        if node.get("depth", 0) > 0:
            if kind == "Thought":
                if thought is not None:  # two thoughts in a row: the first was a turn of its own
                    messages = [*messages, {"role": "assistant", "content": thought}]
                thought = text
            elif kind == "Action":
                action = text
            elif kind == "Action Input" and action is not None:
                call_id = f"call_{sum(m['role'] == 'assistant' for m in messages)}"
                messages = [*messages, {"role": "assistant", "content": thought or "", "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": action, "arguments": text}}]}]
                if node.get("observation") is not None:
                    messages.append({"role": "tool", "tool_call_id": call_id, "name": action,
                                     "content": node["observation"]})
                thought = action = None
        children = node.get("children") or []
        if not children:
            emit(messages + ([{"role": "assistant", "content": thought}] if thought is not None else []))
        for child in children:
            walk(child, messages, thought, action)

    walk(rec["tree"].get("tree") or {}, [], None, None)
    return out


def is_hh_dialogue(text: object) -> bool:
    """Anthropic's dialogue text: turns as ``\\n\\nHuman: `` / ``\\n\\nAssistant: ``."""
    return isinstance(text, str) and text.startswith("\n\nHuman: ")


def hh_dialogue(text: str) -> list[dict]:
    """The dialogue text's turns as user / assistant messages."""
    parts = _TURN.split(text)
    return [{"role": "user" if who == "Human" else "assistant", "content": said}
            for who, said in zip(parts[1::2], parts[2::2])]


def hh_preference(chosen_text: str, rejected_text: str) -> dict | None:
    """A TRL preference record (``prompt``/``chosen``/``rejected`` messages) of one hh-rlhf pair; None when a
    side does not end with an assistant reply (nothing to train on)."""
    chosen, rejected = hh_dialogue(chosen_text), hh_dialogue(rejected_text)
    if not chosen or not rejected or chosen[-1]["role"] != "assistant" or rejected[-1]["role"] != "assistant":
        return None
    if chosen[:-1] == rejected[:-1]:
        return {"prompt": chosen[:-1], "chosen": chosen[-1:], "rejected": rejected[-1:]}
    return {"chosen": chosen, "rejected": rejected}  # the dialogues differ before the last reply: implicit prompt


def is_gsm8k_solutions(rec: dict) -> bool:
    return isinstance(rec.get("question"), str) and any(
        isinstance(v, dict) and "solution" in v for v in rec.values())


def gsm8k_solutions(rec: dict, question_id: str) -> list[dict]:
    """One prompt/completion record per model solution of a GSM8K question: ids ``<question_id>/<model>``,
    ``reward`` 1.0 where ``is_correct``, the question as ``tree_id``."""
    return [{"id": f"{question_id}/{model}", "tree_id": question_id,
             "prompt": [{"role": "user", "content": rec["question"]}],
             "completion": [{"role": "assistant", "content": sol["solution"]}],
             "reward": float(bool(sol.get("is_correct")))}
            for model, sol in rec.items() if isinstance(sol, dict) and "solution" in sol]
