//! The worker report: the summary every worker pushes to each gateway once a second (`POST /kvgate/v1/report`),
//! and its compact, versioned binary encoding.
//!
//! # Wire format (version 7), all integers little-endian
//! ```text
//! magic "KVGR" | version u16 | flags u16 (bit 0: draining; other bits 0)
//! worker_id str | advertise_url str | model_id str            (str = len u16 + UTF-8, at most 1024 bytes)
//! block_size u32 | hash_version u32 | tokenizer_digest u64 | fingerprint u64
//! seq u64 | timestamp_ms u64
//! instance_id u64 | max_model_len u32                          (version 2 on)
//! role u8 | transfer_addr str | kv_bytes_per_token u32         (version 3 on)
//! export_groups u16 | prefill_tokens_per_busy_s f64 | decode_step_s f64 | stall_ratio f64 (0..1)
//! prefill_per_token_s f64 | prefill_attention_s f64                                            (version 5 on)
//! decode_base_s f64 | decode_per_seq_s f64 | decode_per_kv_token_s f64                         (version 7 on)
//! import count u8 (<= 16), then per peer: peer str | bytes u64 | seconds f64 | transfers u32   (version 4 on)
//! waiting_requests u32 | prefill_tokens u64 | running_requests u32
//! prefill_area u64 | prefilling_requests u32                                                   (version 5 on)
//! prefill_tokens_per_s f64 | decode_tokens_per_s f64
//! adapter_slots u16 | adapter count u16 (<= 256), then per adapter: name str | key str                  (version 6 on)
//! tier count u8 (<= 3), then per tier:
//!   tier u8 (0 device, 1 host, 2 disk) | blocks_total u64 | blocks_free u64 | blocks_cached u64
//!   has_summary u8 (0/1) [ granularity u32 | entries u64 | bloom_len u32 | bloom bytes ]
//! ```
//! Version 1 (no `instance_id` / `max_model_len`, flags 0) is still decoded, as `instance_id` 0 and
//! `max_model_len` 0 (unknown), versions 1-2 as role `both` without a transfer listener, versions 1-3 without step
//! timings or imports, versions 1-4 without the prefill fit, the queue's area or its prefilling count (0:
//! unknown), versions 1-5 without LoRA adapters (none held, none loadable), versions 1-6 without the decode fit (0: not
//! measured), so a gateway can be upgraded before its workers. `instance_id` is random per worker process: a new one
//! means a restart, whose `seq` starts again. Nothing may follow the last tier. Decoding is
//! strict: a wrong magic, an unknown version, a truncated field, a
//! value out of range or trailing bytes is a [`ReportError`], never a panic.
//!
//! # Size
//! A tier summary costs its Bloom filter: `-n ln(p) / (ln 2)^2` bits for `n` entries at false-positive rate `p`,
//! i.e. 9.59 bits (1.2 bytes) per entry at 1%. 100K cached blocks at 1% = 119,814 bytes of filter (+45 header),
//! about 120 KB a report (pinned by `report_size_for_100k_blocks` in the tests). Summarising only every k-th block
//! (`granularity`) divides that by k.

mod bloom;

pub use bloom::{BlockBloom, BLOOM_HEADER_BYTES, BLOOM_SEED, MAX_BLOOM_BYTES, MAX_BLOOM_HASH_FUNCTIONS};

use crate::hashing::{BlockHash, HashScheme};

/// Current wire version (the encoder writes it; the decoder also reads versions 1 to 6).
pub const REPORT_VERSION: u16 = 7;
/// Most LoRA adapters one report names (a worker holding more names the most recently used).
pub const MAX_REPORT_ADAPTERS: usize = 256;
/// Longest LoRA adapter name, in bytes (a worker refuses to load an adapter under a longer one).
pub const MAX_ADAPTER_NAME_BYTES: usize = 256;
/// Most prefill peers one report's import figures name (a decode worker importing from more sums the rest into
/// none: the figures are a sample for the gateway's bandwidth estimate, not an account).
pub const MAX_IMPORT_PEERS: usize = 16;
/// `flags` bit: the worker is draining (shutting down) and takes no new requests.
pub const FLAG_DRAINING: u16 = 1;
/// The causal-attention area of `n` prompt tokens computed after `start` tokens of context: `n x (start + n / 2)`
/// (each token attends to everything before it). The unit of [`QueueStats::prefill_area`] and
/// [`StepTiming::prefill_attention_s`]; saturating.
pub fn attention_area(start: u64, n: u64) -> u64 {
    n.saturating_mul(start.saturating_add(n / 2))
}

/// Magic bytes at the start of every report.
pub const REPORT_MAGIC: [u8; 4] = *b"KVGR";
/// Longest string field.
pub const MAX_STRING_BYTES: usize = 1024;
/// Largest encoded report accepted (bodies above it are refused before decoding): three tier summaries, the
/// adapters' names and keys, and the rest.
pub const MAX_REPORT_BYTES: usize = 3 * MAX_BLOOM_BYTES
    + MAX_REPORT_ADAPTERS * (2 * MAX_ADAPTER_NAME_BYTES + 2 * 2 + ADAPTER_DIGEST_CHARS + 1)
    + 4096;
/// Content type of an encoded report.
pub const REPORT_CONTENT_TYPE: &str = "application/x-kvgate-report";

/// Why a report could not be decoded.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ReportError {
    #[error("report truncated while reading {0}")]
    Truncated(&'static str),
    #[error("not a kvgate report (bad magic)")]
    BadMagic,
    #[error("unsupported report version {0} (this build speaks 1 to {REPORT_VERSION})")]
    UnsupportedVersion(u16),
    #[error("invalid report field {field}: {reason}")]
    Invalid { field: &'static str, reason: String },
    #[error("{0} unexpected bytes after the report")]
    TrailingBytes(usize),
    #[error("report of {0} bytes is over the limit of {MAX_REPORT_BYTES}")]
    TooLarge(usize),
}

/// A KV storage tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// Accelerator memory (or the CPU engine's main pool).
    Device = 0,
    /// Host DRAM.
    Host = 1,
    /// Local SSD.
    Disk = 2,
}

impl Tier {
    fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(Tier::Device),
            1 => Some(Tier::Host),
            2 => Some(Tier::Disk),
            _ => None,
        }
    }
}

/// What waits and runs on the worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct QueueStats {
    pub waiting_requests: u32,
    /// Prompt tokens still to prefill, over waiting and running sequences, less what the prefix cache holds for the
    /// waiting ones (the work ahead of a new request, in tokens). Running sequences that only decode count 0 here;
    /// they are in `running_requests`.
    pub prefill_tokens: u64,
    pub running_requests: u32,
    /// The causal-attention area of those tokens: the sum over each sequence of `n x (start + n / 2)` for its `n`
    /// tokens still to prefill after `start` computed or cached (tokens squared; what
    /// [`StepTiming::prefill_attention_s`] prices). Version 5 on; 0 from older workers.
    pub prefill_area: u64,
    /// Running requests still computing their prompt (chunked prefill admits a request before its prompt is
    /// done): with the waiting ones, the requests that have not yet produced a first token. Version 5 on; 0 from
    /// older workers; at most `running_requests`.
    pub prefilling_requests: u32,
}

/// Measured engine throughput over the last interval.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Throughput {
    pub prefill_tokens_per_s: f64,
    pub decode_tokens_per_s: f64,
}

/// The cached block hashes of one tier.
#[derive(Clone, Debug, PartialEq)]
pub struct CacheSummary {
    /// Only every `granularity`-th block's chained hash is in the filter: block `i` (0-based) is included iff
    /// `(i + 1) % granularity == 0`. 1 = every block.
    pub granularity: u32,
    /// How many hashes were inserted.
    pub entries: u64,
    pub bloom: BlockBloom,
}

impl CacheSummary {
    /// Whether block `index` of a sequence is represented at this granularity.
    pub fn covers_block(&self, index: usize) -> bool {
        let g = self.granularity.max(1) as usize;
        (index + 1).is_multiple_of(g)
    }

    /// [`Self::matched_blocks`] in O(log n) lookups: cached prefixes are prefixes, so presence is monotone
    /// except for false positives. A binary search finds the boundary; the granule found and the two before it
    /// are re-checked (a false positive at a probe would have to repeat three times to survive: ~1e-6 at 1%),
    /// and on any doubt the linear walk decides.
    pub fn matched_blocks_fast(&self, hashes: &[BlockHash]) -> usize {
        let g = self.granularity.max(1) as usize;
        let granules = hashes.len() / g;
        let present = |j: usize| self.bloom.contains(hashes[(j + 1) * g - 1]);
        if granules == 0 || !present(0) {
            return 0;
        }
        // Invariant: granule lo present (granules 0..=lo assumed), hi absent or past the end.
        let (mut lo, mut hi) = (0usize, granules);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if present(mid) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let confirmed = (lo.saturating_sub(2)..lo).all(present);
        if confirmed {
            (lo + 1) * g
        } else {
            self.matched_blocks(hashes)
        }
    }

    /// How many leading blocks of `hashes` the filter claims: the longest prefix whose covered blocks are all in
    /// the filter, counted in whole granules.
    pub fn matched_blocks(&self, hashes: &[BlockHash]) -> usize {
        let g = self.granularity.max(1) as usize;
        let mut matched = 0;
        for (i, h) in hashes.iter().enumerate().skip(g - 1).step_by(g) {
            if !self.bloom.contains(*h) {
                break;
            }
            matched = i + 1;
        }
        matched
    }
}

/// KV stats (and optionally the cache summary) of one tier.
#[derive(Clone, Debug, PartialEq)]
pub struct TierReport {
    pub tier: Tier,
    pub blocks_total: u64,
    pub blocks_free: u64,
    /// Blocks holding reusable content (free-but-cached blocks included).
    pub blocks_cached: u64,
    pub summary: Option<CacheSummary>,
}

/// One worker's state, as sent each report interval.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerReport {
    pub worker_id: String,
    /// The URL the gateway should proxy to.
    pub advertise_url: String,
    pub model_id: String,
    pub scheme: HashScheme,
    /// `scheme.fingerprint()` as computed by the sender.
    pub fingerprint: u64,
    /// Increases with every report of one worker process.
    pub seq: u64,
    /// Sender's wall clock, ms since the Unix epoch.
    pub timestamp_ms: u64,
    /// Random per worker process (0: unknown, a version-1 sender); a new value means a restart.
    pub instance_id: u64,
    /// The model's context length in tokens (prompt + output; 0: unknown).
    pub max_model_len: u32,
    /// The worker is shutting down: it finishes what it runs and takes nothing new.
    pub draining: bool,
    pub queue: QueueStats,
    pub throughput: Throughput,
    pub tiers: Vec<TierReport>,
    /// Prefill/decode disaggregation: the worker's role and where it exports KV (version 3; earlier senders read
    /// as `both` with no transfer listener).
    pub pd: PdInfo,
    /// The LoRA adapters it holds and how many it may hold (version 6; earlier senders: none).
    pub lora: LoraInfo,
}

/// Hex digits of the digest in an adapter's key (`name@` + 16 hex digits of BLAKE3 over its files).
pub const ADAPTER_DIGEST_CHARS: usize = 16;

/// A worker's LoRA adapters, as its reports say.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoraInfo {
    /// How many adapters it holds at most (0: it serves none and loads none at run time).
    pub slots: u16,
    /// The adapters it holds, most recently used first.
    pub held: Vec<HeldAdapter>,
}

/// One adapter a worker holds: the name requests give as `model`, and the key its blocks are hashed under
/// (`ExtraKey::LoraAdapter`): `name@` and 16 hex digits of BLAKE3 over its files, so two adapters under one name
/// never share a block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldAdapter {
    pub name: String,
    pub key: String,
}

impl HeldAdapter {
    /// Whether `key` is a well-formed key of an adapter called `name`.
    pub fn key_is_valid(name: &str, key: &str) -> bool {
        key.strip_prefix(name).and_then(|r| r.strip_prefix('@')).is_some_and(|d| {
            d.len() == ADAPTER_DIGEST_CHARS
                && d.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        })
    }
}

/// What a worker can do in a prefill/decode split (`kvgate-worker serve --role`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Whole requests, and either side of a split (the default).
    #[default]
    Both,
    /// Prompts whose KV it hands to a decode worker (and whole requests, as a fallback).
    Prefill,
    /// Requests whose KV it imports from a prefill worker (and whole requests).
    Decode,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Both => "both",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "both" => Ok(Role::Both),
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            o => Err(format!("role {o}: expected both, prefill or decode")),
        }
    }
    fn from_u8(v: u8) -> Option<Self> {
        [Role::Both, Role::Prefill, Role::Decode].get(v as usize).copied()
    }
}

/// A worker's part in prefill/decode disaggregation.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PdInfo {
    pub role: Role,
    /// `host:port` of its KV transfer listener (empty: it exports no KV).
    pub transfer_addr: String,
    /// Bytes of K and V per token across layers, as it moves them (0: unknown).
    pub kv_bytes_per_token: u32,
    /// Layer groups its exports send while the prefill computes (1: whole blocks after it; 0: unknown, a
    /// version-3 sender). Version 4 on, as are the fields below.
    pub export_groups: u16,
    /// Its step timings over the last interval (what a split decision weighs).
    pub timing: StepTiming,
    /// KV it imported over the last interval, by prefill peer (at most [`MAX_IMPORT_PEERS`]).
    pub imports: Vec<PeerImport>,
}

/// Measured step timings of one report interval (0: nothing of that kind ran).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTiming {
    /// Prompt tokens computed per second of the steps that computed prompt tokens.
    pub prefill_tokens_per_s: f64,
    /// Seconds per step of the steps that only decoded (a moving average).
    pub decode_step_s: f64,
    /// Share (0..1) of the time of decode-carrying steps that prefill chunks added: what co-located prefill costs
    /// every stream here.
    pub stall_ratio: f64,
    /// The worker's fit of what its prefill-carrying steps cost (seconds = `prefill_per_token_s x tokens +
    /// prefill_attention_s x area`, the area of a chunk of `n` tokens after `start` being `n x (start + n / 2)`),
    /// over its recent steps. 0 and 0: not measured (a sender before version 5, or no prefill yet). Long prompts
    /// cost more per token than short ones; a token rate alone does not say so.
    pub prefill_per_token_s: f64,
    /// Seconds per unit of attention area (see `prefill_per_token_s`).
    pub prefill_attention_s: f64,
    /// The worker's fit of what a decode-only step costs: seconds = `decode_base_s + decode_per_seq_s x batch +
    /// decode_per_kv_token_s x the KV tokens its sequences attend to`, over its recent steps (version 7 on; all 0:
    /// not measured). What a stream joining its batch will see per token, and what it adds to the others'.
    pub decode_base_s: f64,
    pub decode_per_seq_s: f64,
    pub decode_per_kv_token_s: f64,
}

/// KV imported from one prefill peer over a report interval.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PeerImport {
    /// The peer's transfer address, as the gateway named it.
    pub peer: String,
    pub bytes: u64,
    /// From each transfer's first Blocks frame to its Done (an effective rate: layer-group transfers include the
    /// peer's compute between groups, so it is a lower bound on the link's).
    pub seconds: f64,
    pub transfers: u32,
}

impl WorkerReport {
    /// The tier's report, if present.
    pub fn tier(&self, tier: Tier) -> Option<&TierReport> {
        self.tiers.iter().find(|t| t.tier == tier)
    }

    /// Encodes to the wire format.
    pub fn encode(&self) -> Vec<u8> {
        let bloom_bytes: usize =
            self.tiers.iter().filter_map(|t| t.summary.as_ref()).map(|s| s.bloom.byte_len()).sum();
        let mut w = Vec::with_capacity(256 + bloom_bytes);
        w.extend_from_slice(&REPORT_MAGIC);
        put_u16(&mut w, REPORT_VERSION);
        put_u16(&mut w, if self.draining { FLAG_DRAINING } else { 0 });
        put_str(&mut w, &self.worker_id);
        put_str(&mut w, &self.advertise_url);
        put_str(&mut w, &self.model_id);
        put_u32(&mut w, self.scheme.block_size);
        put_u32(&mut w, self.scheme.hash_version);
        put_u64(&mut w, self.scheme.tokenizer_digest);
        put_u64(&mut w, self.fingerprint);
        put_u64(&mut w, self.seq);
        put_u64(&mut w, self.timestamp_ms);
        put_u64(&mut w, self.instance_id);
        put_u32(&mut w, self.max_model_len);
        w.push(self.pd.role as u8);
        put_str(&mut w, &self.pd.transfer_addr);
        put_u32(&mut w, self.pd.kv_bytes_per_token);
        put_u16(&mut w, self.pd.export_groups);
        let t = &self.pd.timing;
        for v in [
            t.prefill_tokens_per_s,
            t.decode_step_s,
            t.stall_ratio,
            t.prefill_per_token_s,
            t.prefill_attention_s,
            t.decode_base_s,
            t.decode_per_seq_s,
            t.decode_per_kv_token_s,
        ] {
            put_u64(&mut w, v.to_bits());
        }
        let imports = &self.pd.imports[..self.pd.imports.len().min(MAX_IMPORT_PEERS)];
        w.push(imports.len() as u8);
        for i in imports {
            put_str(&mut w, &i.peer);
            put_u64(&mut w, i.bytes);
            put_u64(&mut w, i.seconds.to_bits());
            put_u32(&mut w, i.transfers);
        }
        put_u32(&mut w, self.queue.waiting_requests);
        put_u64(&mut w, self.queue.prefill_tokens);
        put_u32(&mut w, self.queue.running_requests);
        put_u64(&mut w, self.queue.prefill_area);
        put_u32(&mut w, self.queue.prefilling_requests);
        put_u64(&mut w, self.throughput.prefill_tokens_per_s.to_bits());
        put_u64(&mut w, self.throughput.decode_tokens_per_s.to_bits());
        put_u16(&mut w, self.lora.slots);
        let held = &self.lora.held[..self.lora.held.len().min(MAX_REPORT_ADAPTERS)];
        put_u16(&mut w, held.len() as u16);
        for a in held {
            put_str(&mut w, &a.name);
            put_str(&mut w, &a.key);
        }
        w.push(self.tiers.len().min(u8::MAX as usize) as u8);
        for t in &self.tiers {
            w.push(t.tier as u8);
            put_u64(&mut w, t.blocks_total);
            put_u64(&mut w, t.blocks_free);
            put_u64(&mut w, t.blocks_cached);
            match &t.summary {
                None => w.push(0),
                Some(s) => {
                    w.push(1);
                    put_u32(&mut w, s.granularity);
                    put_u64(&mut w, s.entries);
                    let b = s.bloom.as_bytes();
                    put_u32(&mut w, b.len() as u32);
                    w.extend_from_slice(b);
                }
            }
        }
        w
    }

    /// Decodes and validates an untrusted wire form.
    pub fn decode(bytes: &[u8]) -> Result<Self, ReportError> {
        if bytes.len() > MAX_REPORT_BYTES {
            return Err(ReportError::TooLarge(bytes.len()));
        }
        let mut r = Reader { buf: bytes };
        if r.take(4, "magic")? != REPORT_MAGIC {
            return Err(ReportError::BadMagic);
        }
        let version = r.u16("version")?;
        if !(1..=REPORT_VERSION).contains(&version) {
            return Err(ReportError::UnsupportedVersion(version));
        }
        let flags = r.u16("flags")?;
        let known = if version >= 2 { FLAG_DRAINING } else { 0 };
        if flags & !known != 0 {
            return Err(invalid("flags", format!("unknown flags {flags:#x}")));
        }
        let worker_id = r.str("worker_id")?;
        if worker_id.is_empty() {
            return Err(invalid("worker_id", "empty".into()));
        }
        let advertise_url = r.str("advertise_url")?;
        let model_id = r.str("model_id")?;
        let scheme = HashScheme {
            block_size: r.u32("block_size")?,
            hash_version: r.u32("hash_version")?,
            tokenizer_digest: r.u64("tokenizer_digest")?,
        };
        scheme.validate().map_err(|e| invalid("block_size", e))?;
        let fingerprint = r.u64("fingerprint")?;
        let seq = r.u64("seq")?;
        let timestamp_ms = r.u64("timestamp_ms")?;
        let (instance_id, max_model_len) =
            if version >= 2 { (r.u64("instance_id")?, r.u32("max_model_len")?) } else { (0, 0) };
        let pd = if version >= 3 {
            let raw = r.u8("role")?;
            let role = Role::from_u8(raw).ok_or_else(|| invalid("role", format!("unknown role {raw}")))?;
            let mut pd = PdInfo {
                role,
                transfer_addr: r.str("transfer_addr")?,
                kv_bytes_per_token: r.u32("kv_bytes_per_token")?,
                ..PdInfo::default()
            };
            if version >= 4 {
                pd.export_groups = r.u16("export_groups")?;
                pd.timing = StepTiming {
                    prefill_tokens_per_s: r.rate("prefill_tokens_per_busy_s")?,
                    decode_step_s: r.rate("decode_step_s")?,
                    stall_ratio: r.rate("stall_ratio")?,
                    ..StepTiming::default()
                };
                if version >= 5 {
                    pd.timing.prefill_per_token_s = r.rate("prefill_per_token_s")?;
                    pd.timing.prefill_attention_s = r.rate("prefill_attention_s")?;
                }
                if version >= 7 {
                    pd.timing.decode_base_s = r.rate("decode_base_s")?;
                    pd.timing.decode_per_seq_s = r.rate("decode_per_seq_s")?;
                    pd.timing.decode_per_kv_token_s = r.rate("decode_per_kv_token_s")?;
                }
                if pd.timing.stall_ratio > 1.0 {
                    return Err(invalid("stall_ratio", format!("{} is over 1", pd.timing.stall_ratio)));
                }
                let n = r.u8("import count")? as usize;
                if n > MAX_IMPORT_PEERS {
                    return Err(invalid("imports", format!("{n} peers (at most {MAX_IMPORT_PEERS})")));
                }
                for _ in 0..n {
                    pd.imports.push(PeerImport {
                        peer: r.str("import peer")?,
                        bytes: r.u64("import bytes")?,
                        seconds: r.rate("import seconds")?,
                        transfers: r.u32("import transfers")?,
                    });
                }
            }
            pd
        } else {
            PdInfo::default()
        };
        let queue = QueueStats {
            waiting_requests: r.u32("waiting_requests")?,
            prefill_tokens: r.u64("prefill_tokens")?,
            running_requests: r.u32("running_requests")?,
            prefill_area: if version >= 5 { r.u64("prefill_area")? } else { 0 },
            prefilling_requests: if version >= 5 { r.u32("prefilling_requests")? } else { 0 },
        };
        if queue.prefilling_requests > queue.running_requests {
            return Err(invalid(
                "prefilling_requests",
                format!("{} of {} running", queue.prefilling_requests, queue.running_requests),
            ));
        }
        let throughput = Throughput {
            prefill_tokens_per_s: r.rate("prefill_tokens_per_s")?,
            decode_tokens_per_s: r.rate("decode_tokens_per_s")?,
        };
        let lora = if version >= 6 { r.lora()? } else { LoraInfo::default() };
        let n_tiers = r.u8("tier count")?;
        if n_tiers > 3 {
            return Err(invalid("tiers", format!("{n_tiers} tiers (at most 3)")));
        }
        let mut tiers: Vec<TierReport> = Vec::with_capacity(n_tiers as usize);
        for _ in 0..n_tiers {
            let raw = r.u8("tier")?;
            let tier = Tier::from_u8(raw).ok_or_else(|| invalid("tier", format!("unknown tier {raw}")))?;
            if tiers.iter().any(|t| t.tier == tier) {
                return Err(invalid("tier", format!("{tier:?} appears twice")));
            }
            let blocks_total = r.u64("blocks_total")?;
            let blocks_free = r.u64("blocks_free")?;
            let blocks_cached = r.u64("blocks_cached")?;
            if blocks_free > blocks_total || blocks_cached > blocks_total {
                return Err(invalid(
                    "blocks_free",
                    format!("free {blocks_free} / cached {blocks_cached} exceed total {blocks_total}"),
                ));
            }
            let summary = match r.u8("has_summary")? {
                0 => None,
                1 => {
                    let granularity = r.u32("granularity")?;
                    if granularity == 0 {
                        return Err(invalid("granularity", "must be at least 1".into()));
                    }
                    let entries = r.u64("entries")?;
                    let len = r.u32("bloom_len")? as usize;
                    let raw = r.take(len, "bloom")?;
                    let bloom = BlockBloom::from_bytes(raw).map_err(|e| invalid("bloom", e))?;
                    Some(CacheSummary { granularity, entries, bloom })
                }
                other => return Err(invalid("has_summary", format!("{other} is not 0 or 1"))),
            };
            tiers.push(TierReport { tier, blocks_total, blocks_free, blocks_cached, summary });
        }
        if !r.buf.is_empty() {
            return Err(ReportError::TrailingBytes(r.buf.len()));
        }
        Ok(WorkerReport {
            worker_id,
            advertise_url,
            model_id,
            scheme,
            fingerprint,
            seq,
            timestamp_ms,
            instance_id,
            max_model_len,
            draining: flags & FLAG_DRAINING != 0,
            queue,
            throughput,
            tiers,
            pd,
            lora,
        })
    }
}

fn invalid(field: &'static str, reason: String) -> ReportError {
    ReportError::Invalid { field, reason }
}

fn put_u16(w: &mut Vec<u8>, v: u16) {
    w.extend_from_slice(&v.to_le_bytes());
}
fn put_u32(w: &mut Vec<u8>, v: u32) {
    w.extend_from_slice(&v.to_le_bytes());
}
fn put_u64(w: &mut Vec<u8>, v: u64) {
    w.extend_from_slice(&v.to_le_bytes());
}
fn put_str(w: &mut Vec<u8>, s: &str) {
    // Longer strings are cut at a char boundary so the encoder never writes what the decoder refuses.
    let mut end = s.len().min(MAX_STRING_BYTES);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    put_u16(w, end as u16);
    w.extend_from_slice(&s.as_bytes()[..end]);
}

/// Bounds-checked little-endian reader over untrusted bytes.
struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], ReportError> {
        if self.buf.len() < n {
            return Err(ReportError::Truncated(what));
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }
    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], ReportError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }
    fn u8(&mut self, what: &'static str) -> Result<u8, ReportError> {
        Ok(self.array::<1>(what)?[0])
    }
    fn u16(&mut self, what: &'static str) -> Result<u16, ReportError> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, ReportError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &'static str) -> Result<u64, ReportError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }
    fn rate(&mut self, what: &'static str) -> Result<f64, ReportError> {
        let v = f64::from_bits(self.u64(what)?);
        if !v.is_finite() || v < 0.0 {
            return Err(invalid(what, format!("{v} is not a finite non-negative rate")));
        }
        Ok(v)
    }
    /// The adapters part (version 6): at most [`MAX_REPORT_ADAPTERS`], names non-empty, at most
    /// [`MAX_ADAPTER_NAME_BYTES`] and distinct, keys well formed ([`HeldAdapter::key_is_valid`]).
    fn lora(&mut self) -> Result<LoraInfo, ReportError> {
        let slots = self.u16("adapter_slots")?;
        let n = self.u16("adapter count")? as usize;
        if n > MAX_REPORT_ADAPTERS {
            return Err(invalid("adapters", format!("{n} adapters (at most {MAX_REPORT_ADAPTERS})")));
        }
        let mut held: Vec<HeldAdapter> = Vec::with_capacity(n);
        for _ in 0..n {
            let name = self.str("adapter name")?;
            let key = self.str("adapter key")?;
            if name.is_empty() || name.len() > MAX_ADAPTER_NAME_BYTES {
                return Err(invalid(
                    "adapter name",
                    format!("{} bytes (1 to {MAX_ADAPTER_NAME_BYTES})", name.len()),
                ));
            }
            if !HeldAdapter::key_is_valid(&name, &key) {
                return Err(invalid("adapter key", format!("{key:?} is not {name:?}@ and 16 hex digits")));
            }
            if held.iter().any(|a| a.name == name) {
                return Err(invalid("adapter name", format!("{name:?} appears twice")));
            }
            held.push(HeldAdapter { name, key });
        }
        Ok(LoraInfo { slots, held })
    }

    fn str(&mut self, what: &'static str) -> Result<String, ReportError> {
        let len = self.u16(what)? as usize;
        if len > MAX_STRING_BYTES {
            return Err(invalid(what, format!("{len} bytes (at most {MAX_STRING_BYTES})")));
        }
        let raw = self.take(len, what)?;
        String::from_utf8(raw.to_vec()).map_err(|_| invalid(what, "not UTF-8".into()))
    }
}

#[cfg(test)]
mod tests;
