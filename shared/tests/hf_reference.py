"""Reference tokenization with Hugging Face `transformers` (the library that defines chat templates).

Reads {"model_dir": ..., "cases": [...]} on stdin; each case is {"chat": messages, "add_generation_prompt": bool,
"tools": ...?} or {"text": str}. Prints the token ids of every case as one JSON list.
"""
import json
import sys

from transformers import AutoTokenizer


def main() -> None:
    req = json.load(sys.stdin)
    tok = AutoTokenizer.from_pretrained(req["model_dir"])
    out = []
    for case in req["cases"]:
        if "chat" in case:
            ids = tok.apply_chat_template(
                case["chat"],
                tools=case.get("tools"),
                add_generation_prompt=case.get("add_generation_prompt", True),
                tokenize=True,
                **case.get("kwargs", {}),
            )
            if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
            out.append(list(ids))
        else:
            out.append(tok(case["text"])["input_ids"])
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
