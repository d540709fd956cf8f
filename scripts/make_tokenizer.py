"""Write the project's character-level tokenizer to ``assets/tokenizer/`` (run once; committed).

A Hugging Face ``tokenizers`` file (``tokenizer.json``, the ecosystem's format) whose
tokens are single characters: the embedded default's tasks only use digits, arithmetic
and comparison signs, lowercase letters and a little punctuation. Ids 0-3 are specials.
"""

import json
import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARACTERS = string.digits + string.ascii_lowercase + " +-*/=<>()[],.;:#?!\n"


def build() -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(CHARACTERS))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(SPECIALS)
    return tokenizer


def main() -> None:
    out = Path(__file__).resolve().parents[1] / "assets" / "tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    build().save(str(out / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
              "add_bos_token": False, "add_eos_token": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {out} ({len(SPECIALS) + len(CHARACTERS)} tokens)")


if __name__ == "__main__":
    main()
