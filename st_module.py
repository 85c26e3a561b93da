"""Our runs that no Transformer -> Pooling chain encodes, as sentence-transformers modules: a JTCSE
twin (jtcse.py) and a BeLLM adapter (bellm.py). Each is ONE module, tokeniser to embedding, with the
encode function of its script (eval_sts.py scores the same vectors: within 1e-5 in fp32).

  from sentence_transformers import SentenceTransformer
  model = SentenceTransformer("runs/jtcse/best", trust_remote_code=True)   # or runs/bellm/best
  embeddings = model.encode(["A man is playing a guitar.", "Someone plays music."])  # (2, H)

This file is copied into best/ (common.write_st_files, at every save) beside modules.json, whose
"type" names its class (st_module.JTCSETwin, st_module.BeLLM): sentence-transformers imports a
class from outside its own package only with trust_remote_code=True, and otherwise refuses in its
own words ("... Please pass the argument `trust_remote_code=True` to allow custom code to be
run."). A module's config is the folder's sentemb.json, the run's own description (the one our
scripts read). It imports torch, transformers, peft and sentence-transformers, never our scripts:
best/ loads without them.
"""
import copy
import json
import math
import os
import warnings

import torch
from sentence_transformers.base.modules import InputModule


class SentembModule(InputModule):
    """What both kinds share: the config is sentemb.json, read whole and saved back whole;
    max_seq_length is the tokens of a sentence read (sentemb.json's max_len)."""
    config_file_name = "sentemb.json"

    @classmethod
    def load(cls, model_name_or_path, subfolder="", token=None, cache_folder=None, revision=None,
             local_files_only=False, **kwargs):
        """best/ (a folder, or a hub repository downloaded whole) -> the module."""
        folder = cls.load_dir_path(model_name_or_path, subfolder, token, cache_folder, revision,
                                   local_files_only)
        with open(os.path.join(folder, cls.config_file_name), encoding="utf-8") as f:
            return cls(folder, json.load(f))

    def get_config_dict(self):
        # fingerprints name the files of our save; a re-save writes its own
        return {k: v for k, v in self.meta.items() if k != "fingerprints"}


# ---------------------------------------------------------------- JTCSE: the twin -----------------
def drop_layernorm(tower, n):
    """Fig. 8 (jtcse.drop_layernorm): the output LayerNorm of the tower's last n layers passes the
    residual sum through (its weights stay in the file, unused). -> the tower"""
    for layer in tower.encoder.layer[-n:] if n else []:
        layer.output.LayerNorm.forward = torch.nn.Identity().forward
    return tower


class JTCSETwin(SentembModule):
    """JTCSE's embedding (jtcse.make_encode): e = CLS(I) + CLS(II), each tower's last hidden state
    at [CLS]; no pooler, no cross-attention (the authors' evaluation). sentemb.json: towers (their
    folders in best/; ["."]: one distilled tower, here when drop_layernorm drops LayerNorms, which
    no Transformer module does: eval_sts.py --export-st), max_len (tokens read, truncated),
    drop_layernorm N (Fig. 8)."""

    def __init__(self, folder, meta):
        super().__init__()
        from transformers import AutoModel, AutoTokenizer
        self.meta = meta
        paths = [os.path.join(folder, t) for t in meta["towers"]]
        self.towers = torch.nn.ModuleList(
            drop_layernorm(AutoModel.from_pretrained(p), meta.get("drop_layernorm", 0))
            for p in paths)
        self.tokenizer = AutoTokenizer.from_pretrained(paths[0])  # the towers share it
        self.max_seq_length = meta["max_len"]

    def preprocess(self, inputs, prompt=None, **kwargs):
        """Sentences (a sentence-transformers prompt prepended) -> one padded batch (b, L)."""
        texts = [(prompt or "") + s for s in inputs]
        return dict(self.tokenizer(texts, padding=True, truncation=True,
                                   max_length=self.max_seq_length, return_tensors="pt"))

    def forward(self, features, **kwargs):
        batch = {k: features[k] for k in ("input_ids", "attention_mask", "token_type_ids")
                 if k in features}
        features["sentence_embedding"] = sum(  # Σ_towers CLS: (b, H)
            tower(**batch).last_hidden_state[:, 0] for tower in self.towers)
        return features

    def get_embedding_dimension(self):
        return self.towers[0].config.hidden_size

    def save(self, output_path, *args, **kwargs):
        """Plain AutoModel folders, one per tower (each with the tokenizer), and sentemb.json."""
        for name, tower in zip(self.meta["towers"], self.towers):
            tower.save_pretrained(os.path.join(output_path, name))
            self.tokenizer.save_pretrained(os.path.join(output_path, name))
        self.save_config(output_path)


# ---------------------------------------------------------------- BeLLM ---------------------------
def attn_mask(attention_mask, causal, dtype):
    """bellm.attn_mask: (b, L) 1 = real token -> (b, 1, L, L) additive mask, 0 where query i may
    read key j: a real token (eq. 4), at j <= i when causal (eq. 3); the diagonal always."""
    L = attention_mask.shape[1]
    keep = attention_mask[:, None, None, :].bool()
    if causal:
        keep = keep & torch.ones(L, L, dtype=torch.bool, device=keep.device).tril()
    keep = keep | torch.eye(L, dtype=torch.bool, device=keep.device)  # no empty row (padding)
    zeros = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
    return zeros.masked_fill(~keep, torch.finfo(dtype).min)


def bidirectional(dec, input_ids, attention_mask, K, mode, strategy):
    """Mirrors bellm.decoder_forward: the final-norm hidden states (b, L, H) of the decoder whose
    last K layers are bidirectional. parallel, eq. 5: h = LLM->(x) + BiLLM<->(x), both from the
    token embeddings x (K = all layers: h = BiLLM(x)); sequential (BiLLM): the last K layers
    continue the causal stack, bidirectional; strategy add: K copies of the last layers
    (dec.bellm_added) are BiLLM, and all n layers LLM->."""
    x = dec.embed_tokens(input_ids)  # (b, L, H)
    pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # real tokens only (left padding)
    kw = dict(position_embeddings=dec.rotary_emb(x, pos), position_ids=pos)
    n = len(dec.layers)
    if strategy == "add":
        causal, bi = dec.layers, (dec.bellm_added if K else [])
    else:
        causal, bi = dec.layers[:n - K], dec.layers[n - K:]
    h = x
    m = attn_mask(attention_mask, True, x.dtype)  # (b, 1, L, L)
    for layer in causal:  # LLM->: eq. 3
        h = layer(h, attention_mask=m, **kw)
    if K:
        g = x if mode == "parallel" else h
        m = attn_mask(attention_mask, False, x.dtype)
        for layer in bi:  # BiLLM<->: eq. 4
            g = layer(g, attention_mask=m, **kw)
        h = g if mode == "sequential" or len(causal) == 0 else h + g  # eq. 5
    return dec.norm(h)


def check_base(dec, meta):
    """The base model is the one the adapter was trained on: its weights' sums as sentemb.json
    records them (bellm.base_checksums), or a ValueError naming base_model."""
    w = [q.detach() for n, q in dec.named_parameters() if "lora_" not in n]
    sums = {"base_checksum": float(sum(x.double().abs().sum() for x in (
                dec.embed_tokens.weight.detach(), dec.norm.weight.detach()))),
            "base_fingerprint": float(sum(i * x.to(torch.bfloat16).float().abs().sum(
                dtype=torch.float64) for i, x in enumerate(w, 1)))}
    for key, value in sums.items():
        if meta.get(key) is not None and not math.isclose(value, meta[key], rel_tol=1e-6):
            raise ValueError(f"'{meta['base_model']}' is not the base model this adapter was "
                             f"trained on (its {key} is {value:.6g}, sentemb.json records "
                             f"{meta[key]:.6g}): set base_model in sentemb.json to that model")


def fill(prompt, sentence):
    """bellm.fill: the prompted text (§3.3); a {condition} (C-STS) is left empty."""
    return prompt.replace("{sentence}", sentence).replace("{condition}", "")


class BeLLM(SentembModule):
    """BeLLM's embedding (bellm.make_encode): each sentence, cut to max_len tokens, fills the prompt
    (§3.3); the decoder with its last K layers bidirectional
    (eqs. 4-5) and the LoRA adapter of best/ reads it; the final-norm hidden state of its last real
    token is the embedding. sentemb.json: base_model (a hub name, or a folder: relative paths
    from the working directory), bi_layers K, bi_mode, bi_strategy, prompt, dtype, max_len."""

    def __init__(self, folder, meta):
        super().__init__()
        from peft import PeftModel
        from transformers import AutoModel, AutoTokenizer
        cfg = {"bi_strategy": "convert", **meta}
        self.meta = cfg
        self.tokenizer = AutoTokenizer.from_pretrained(cfg["base_model"])
        if self.tokenizer.pad_token is None:  # padding is masked everywhere
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # eager attention, as bellm.py evaluates on a CPU: SDPA with a 4-D mask is 5x slower there
        # and 2x further from eval_sts.py's vectors (SmolLM2-135M, STS-B dev: 1.6e-5 vs 7.9e-6)
        dec = AutoModel.from_pretrained(cfg["base_model"], attn_implementation="eager",
                                        dtype=getattr(torch, cfg.get("dtype", "float32")))
        n, K = len(dec.layers), cfg["bi_layers"]
        if cfg["bi_strategy"] == "add":  # Table 4 "addition": bidirectional copies of the last K
            dec.bellm_added = torch.nn.ModuleList(copy.deepcopy(m) for m in dec.layers[n - K:])
        check_base(dec, cfg)
        with warnings.catch_warnings():  # peft on transformers 5
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated")
            self.model = PeftModel.from_pretrained(dec, folder).eval()  # LoRA wrapped into dec
        self.max_seq_length = cfg.get("max_len", dec.config.max_position_embeddings)

    def preprocess(self, inputs, prompt=None, **kwargs):
        """Sentences (a sentence-transformers prompt prepended) -> the prompted texts' tokens
        (bellm.prompted): a sentence is cut before it enters the prompt, never the prompt's end
        (`is:"`, read by the pooled last token)."""
        tok = self.tokenizer
        n = self.max_seq_length  # tokens of a sentence
        template = self.meta["prompt"]

        def cut(s):
            ids = tok(s, add_special_tokens=False)["input_ids"]
            return s if len(ids) <= n else tok.decode(ids[:n])
        texts = [fill(template, cut((prompt or "") + s)) for s in inputs]
        limit = n + len(tok(fill(template, ""))["input_ids"]) + 8
        return dict(tok(texts, padding=True, truncation=True, max_length=limit,
                        return_tensors="pt"))

    def forward(self, features, **kwargs):
        mask = features["attention_mask"]  # (b, L)
        h = bidirectional(self.model.base_model.model, features["input_ids"], mask,
                          self.meta["bi_layers"], self.meta["bi_mode"], self.meta["bi_strategy"])
        last = (mask * torch.arange(mask.shape[1], device=mask.device)).argmax(1)  # left or right
        features["sentence_embedding"] = h[torch.arange(len(h), device=h.device), last]  # (b, H)
        return features

    def get_embedding_dimension(self):
        return self.model.base_model.model.config.hidden_size

    def save(self, output_path, *args, **kwargs):
        """The adapter (adapter_config.json, adapter_model.safetensors) and sentemb.json."""
        self.model.save_pretrained(output_path)
        self.save_config(output_path)
