"""Tokenizers: a checkpoint's tokenizer.json (the `tokenizers` library) when it ships one,
bytes otherwise."""
import json

from tokenizers import Tokenizer, models, pre_tokenizers

from kvmesh.workers.checkpoint.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer


def write_word_level(path, words):
    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0].content }}"}))


def test_a_checkpoint_tokenizer_json_is_used_with_its_chat_template(tmp_path):
    write_word_level(tmp_path, ["hello", "kv", "mesh"])
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hello mesh kv unknown") == [3, 5, 4, 2]
    assert tok.decode([3, 4]) == "hello kv"
    assert tok.chat_template == "{{ messages[0].content }}"


def test_checkpoints_without_a_tokenizer_get_utf8_bytes(tmp_path):
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, ByteTokenizer)
    ids = tok.encode("héllo")
    assert len(ids) == len("héllo".encode()) and min(ids) >= 3
    assert tok.decode(ids) == "héllo"
    assert tok.decode([0, 1] + ids + [300]) == "héllo"      # specials and out-of-byte ids decode to nothing
