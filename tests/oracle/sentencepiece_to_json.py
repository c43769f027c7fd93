#!/usr/bin/env python3
"""Writes the tokenizer.json Hugging Face's `transformers` makes from a SentencePiece BPE
tokenizer.model (its LlamaConverter, legacy): the same vocabulary, merges recovered from the pieces
and their scores as its SentencePieceExtractor does, the Llama normalizer (Prepend "▁", Replace
" " -> "▁"), byte fallback, BOS template and decoders. tokenizer_test runs Hugging Face's Rust
library and strata's tokenizer.json path on it, against strata's tokenizer.model path.

    python3 sentencepiece_to_json.py TOKENIZER_MODEL OUT_JSON

The model file is a protobuf; its pieces (ModelProto field 1: piece 1, score 2, type 3) are read
here by hand, so no protobuf package is needed."""
import json
import struct
import sys


def varint(buf, i):
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return value, i


def fields(buf):
    i = 0
    while i < len(buf):
        key, i = varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            value, i = varint(buf, i)
        elif wire == 1:
            value, i = buf[i:i + 8], i + 8
        elif wire == 2:
            n, i = varint(buf, i)
            value, i = buf[i:i + n], i + n
        elif wire == 5:
            value, i = buf[i:i + 4], i + 4
        else:
            raise ValueError(f"protobuf wire type {wire} is not expected in a SentencePiece model")
        yield num, value


def main():
    model_path, out_path = sys.argv[1:3]
    pieces = []  # (piece, score, type); type 1 normal, 2 unknown, 3 control, 4 user, 6 byte
    model_type = 1
    for num, value in fields(open(model_path, "rb").read()):
        if num == 1:
            piece, score, kind = "", 0.0, 1
            for n, v in fields(value):
                if n == 1:
                    piece = v.decode("utf-8")
                elif n == 2:
                    score = struct.unpack("<f", v)[0]
                elif n == 3:
                    kind = v
            pieces.append((piece, score, kind))
        elif num == 2:  # TrainerSpec: model_type is field 3 (1 unigram, 2 bpe)
            for n, v in fields(value):
                if n == 3:
                    model_type = v
    if model_type != 2:
        sys.exit(f"{model_path}: not a BPE model (model_type {model_type}); only BPE converts")
    vocab = {p: i for i, (p, _, _) in enumerate(pieces)}
    # SentencePieceExtractor: every split of every piece into two pieces, ordered by the merged
    # piece's score (highest first), then by the parts' ids.
    merges = []
    for piece, score, _ in pieces:
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: m[2], reverse=True)
    special = [(i, p) for i, (p, _, kind) in enumerate(pieces) if kind in (2, 3)]
    bos = next(p for _, p in special if p == "<s>")
    tokenizer = {
        "version": "1.0",
        "added_tokens": [{"id": i, "content": p, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}
                         for i, p in special],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [vocab[bos]], "tokens": [bos]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>",
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": True, "byte_fallback": True, "vocab": vocab,
                  "merges": [f"{a} {b}" for a, b, _ in merges]},
    }
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(tokenizer, f, ensure_ascii=False)


if __name__ == "__main__":
    main()
