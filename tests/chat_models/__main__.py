"""`python -m tests.chat_models`: assemble every family's tokenizer directory (bootstrap runs it)."""

from tests.chat_models import FAMILIES, tokenizer_dir

for family in FAMILIES:
    print(tokenizer_dir(family))
