//! The SSD tier across real `kvgate-worker serve` restarts: weights swapped in the same model directory are never
//! served the old model's KV (the same text as a fresh directory); a restart over a tier far larger than the
//! worker's memory holds only the index (peak RSS measured against the tier's size); a disk that fills up
//! mid-record leaves no torn record and the tier keeps writing in new segments; and two workers cannot share one
//! directory.

mod common;

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

fn synth(out: &Path, preset: &str, seed: u64) {
    let status = Command::new(env!("CARGO_BIN_EXE_kvgate-worker"))
        .args(["synth-model", "--out"])
        .arg(out)
        .args(["--preset", preset, "--seed", &seed.to_string()])
        .stdout(Stdio::null())
        .status()
        .expect("synth-model");
    assert!(status.success());
}

fn tier_flags<'a>(model: &'a str, ssd: &'a str) -> Vec<&'a str> {
    vec![
        "--model",
        model,
        "--disk-kv-path",
        ssd,
        "--disk-kv-bytes",
        "67108864",
        "--kv-write-policy",
        "write-through",
        "--kv-cache-tokens",
        "4096",
    ]
}

async fn gauge(w: &Worker, name: &str) -> f64 {
    metric(&get(&format!("{}/metrics", w.base)).await.body, name).unwrap_or(0.0)
}

async fn wait_gauge(w: &Worker, name: &str, at_least: f64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while gauge(w, name).await < at_least {
        assert!(Instant::now() < deadline, "{name} never reached {at_least}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// (text, cached tokens) of a greedy completion.
async fn complete(w: &Worker, prompt: &[u32]) -> (String, u64) {
    let r = post(
        &format!("{}/v1/completions", w.base),
        &json!({"model": "m", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": true}),
        &[],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    (v["choices"][0]["text"].as_str().expect("text").to_owned(), cached)
}

fn ids(n: u32) -> Vec<u32> {
    (0..n).map(|i| (i * 37 + 11) % 500 + 1).collect()
}

#[tokio::test]
async fn weights_swapped_in_the_same_directory_never_get_the_old_models_kv() {
    let dir = tempfile::tempdir().expect("tmp");
    let (model, other, fresh_model) =
        (dir.path().join("m"), dir.path().join("other"), dir.path().join("fresh"));
    synth(&model, "tiny", 1);
    synth(&other, "tiny", 2);
    let (m, ssd, ssd2) = (model.display().to_string(), dir.path().join("ssd"), dir.path().join("ssd2"));
    let (ssd, ssd2) = (ssd.display().to_string(), ssd2.display().to_string());
    let prompt = ids(200);
    let mut w = serve(&[&tier_flags(&m, &ssd)[..], &["--model-id", "m"]].concat());
    complete(&w, &prompt).await;
    wait_gauge(&w, "kvgate_worker_disk_kv_written_blocks", 12.0).await;
    w.child.kill().expect("kill");
    let _ = w.child.wait();
    // Other weights of the same shape, tokenizer and config (a fine-tune) replace the old ones in place.
    std::fs::copy(other.join("model.safetensors"), model.join("model.safetensors")).expect("swap weights");
    let w = serve(&[&tier_flags(&m, &ssd)[..], &["--model-id", "m"]].concat());
    assert_eq!(
        gauge(&w, "kvgate_worker_disk_kv_recovered_blocks").await,
        0.0,
        "no record is the new model's"
    );
    let (swapped, cached) = complete(&w, &prompt).await;
    assert_eq!(cached, 0, "nothing served from the old model's KV");
    // The same weights in a fresh directory with a fresh tier: the same text.
    std::fs::create_dir_all(&fresh_model).expect("mkdir");
    for f in std::fs::read_dir(&model).expect("dir").filter_map(|e| e.ok()) {
        std::fs::copy(f.path(), fresh_model.join(f.file_name())).expect("copy");
    }
    let fm = fresh_model.display().to_string();
    let f = serve(&[&tier_flags(&fm, &ssd2)[..], &["--model-id", "m"]].concat());
    let (want, _) = complete(&f, &prompt).await;
    assert_eq!(swapped, want);
}

/// Peak resident memory of a process, in KiB.
fn peak_rss_kib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmHWM")
}

#[tokio::test]
async fn a_restart_over_a_tier_larger_than_memory_holds_only_its_index() {
    let dir = tempfile::tempdir().expect("tmp");
    let model = dir.path().join("m");
    synth(&model, "small", 3);
    let (m, ssd) = (model.display().to_string(), dir.path().join("ssd"));
    let ssd_s = ssd.display().to_string();
    let tier: u64 = 256 << 20;
    let flags = |extra: &str| {
        vec![
            "--model".to_owned(),
            m.clone(),
            "--disk-kv-path".into(),
            ssd_s.clone(),
            "--disk-kv-bytes".into(),
            extra.to_owned(),
            "--kv-write-policy".into(),
            "write-through".into(),
            "--kv-cache-tokens".into(),
            "1024".into(),
        ]
    };
    // A first run writes one record: its header carries the tier's fingerprint for this model and layout.
    let size = (tier + (64 << 20)).to_string();
    let args = flags(&size);
    let mut w = serve(&args.iter().map(String::as_str).collect::<Vec<_>>());
    complete(&w, &ids(20)).await;
    wait_gauge(&w, "kvgate_worker_disk_kv_written_blocks", 1.0).await;
    let baseline_kib = peak_rss_kib(w.child.id());
    w.child.kill().expect("kill");
    let _ = w.child.wait();
    let seg = std::fs::read_dir(&ssd)
        .expect("dir")
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| {
            p.extension().is_some_and(|x| x == "kvd") && std::fs::metadata(p).is_ok_and(|m| m.len() > 0)
        })
        .expect("a written segment");
    let first = std::fs::read(&seg).expect("read");
    let (record, _) = kvgate_worker::kv::segment::Record::decode(
        &first,
        u64::from_le_bytes(first[8..16].try_into().expect("8")),
    )
    .expect("a whole record");
    // Fill the tier to 256 MiB of such records (roots of their own chains), 64 MiB segments as the worker writes.
    let per = record.encode().len() as u64;
    let n = tier / per;
    let mut file = Vec::with_capacity(64 << 20);
    let mut seg_no = 100u32;
    for i in 0..n {
        let r = kvgate_worker::kv::segment::Record {
            hash: kvgate_shared::hashing::BlockHash(0x5eed_0000_0000 + i),
            parent: None,
            index: 0,
            check: i,
            ..record.clone()
        };
        file.extend(r.encode());
        if file.len() as u64 + per > 64 << 20 || i + 1 == n {
            std::fs::write(ssd.join(format!("seg-{seg_no:08}.kvd")), &file).expect("write segment");
            file.clear();
            seg_no += 1;
        }
    }
    let w = serve(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let recovered = gauge(&w, "kvgate_worker_disk_kv_recovered_blocks").await;
    assert!(recovered >= n as f64, "{recovered} of {n} records indexed");
    let peak_kib = peak_rss_kib(w.child.id());
    let grew = peak_kib.saturating_sub(baseline_kib);
    eprintln!(
        "rebuild of {} MiB ({n} records of {per} bytes): peak RSS {} MiB, {} MiB over the first run's {} MiB ({:.3} of the tier)",
        tier >> 20,
        peak_kib >> 10,
        grew >> 10,
        baseline_kib >> 10,
        (grew << 10) as f64 / tier as f64
    );
    assert!(
        grew << 10 < tier / 16,
        "the rebuild took {grew} KiB more than the first run for a {tier}-byte tier"
    );
    // And it serves what it indexed.
    let (_, cached) = complete(&w, &ids(20)).await;
    assert!(cached >= 16, "the first run's block is served after the restart");
}

#[tokio::test]
async fn a_disk_that_fills_up_mid_record_leaves_no_torn_record() {
    let dir = tempfile::tempdir().expect("tmp");
    let model = dir.path().join("m");
    synth(&model, "tiny", 1);
    let (m, ssd) = (model.display().to_string(), dir.path().join("ssd").display().to_string());
    // Files of this worker may not grow past 100 KiB (about 12 records): each segment fills up part-way through a
    // record, as a full disk would. SIGXFSZ ignored: the write fails with EFBIG instead of killing the process.
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvgate-worker"));
    cmd.args(["serve", "--host", "127.0.0.1", "--port", "0", "--model-id", "m"]).args(tier_flags(&m, &ssd));
    // SAFETY: only async-signal-safe calls (setrlimit, signal) between fork and exec.
    #[allow(unsafe_code)]
    unsafe {
        cmd.pre_exec(|| {
            let lim = libc::rlimit { rlim_cur: 100 << 10, rlim_max: 100 << 10 };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            Ok(())
        });
    }
    let mut w = spawn_ready(cmd, None);
    for k in 0..4u32 {
        let prompt: Vec<u32> = (0..320).map(|i| (i * 13 + k * 101) % 500 + 1).collect();
        complete(&w, &prompt).await;
    }
    // 80 blocks written through; the first segment stopped at its limit, the rest went on in new segments.
    wait_gauge(&w, "kvgate_worker_disk_kv_written_blocks", 40.0).await;
    let dropped = gauge(&w, "kvgate_worker_disk_kv_dropped_writes").await;
    assert!(dropped >= 1.0, "a write hit the limit");
    let written = gauge(&w, "kvgate_worker_disk_kv_written_blocks").await;
    w.child.kill().expect("kill");
    let _ = w.child.wait();
    // Restarted without the limit: every whole record is found and nothing is torn.
    let w = serve(&[&tier_flags(&m, &ssd)[..], &["--model-id", "m"]].concat());
    assert_eq!(gauge(&w, "kvgate_worker_disk_kv_corrupt_blocks").await, 0.0, "no torn record");
    assert!(gauge(&w, "kvgate_worker_disk_kv_recovered_blocks").await > 0.0);
    eprintln!("{written} blocks written, {dropped} writes failed at the size limit, none torn");
}

#[tokio::test]
async fn two_workers_cannot_share_one_tier_directory() {
    let dir = tempfile::tempdir().expect("tmp");
    let model = dir.path().join("m");
    synth(&model, "tiny", 1);
    let (m, ssd) = (model.display().to_string(), dir.path().join("ssd"));
    let ssd_s = ssd.display().to_string();
    let _first = serve(&tier_flags(&m, &ssd_s));
    let mut second = Command::new(env!("CARGO_BIN_EXE_kvgate-worker"))
        .args(["serve", "--host", "127.0.0.1", "--port", "0"])
        .args(tier_flags(&m, &ssd_s))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("second worker");
    // It must exit by itself (after the lock wait); one that serves is killed and fails the test.
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = second.try_wait().expect("wait") {
            break s;
        }
        if Instant::now() > deadline {
            let _ = second.kill();
            let _ = second.wait();
            panic!("the second worker started on a directory another worker holds");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!status.success(), "the second worker must not start");
    let out = second.wait_with_output().expect("output");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("in use by another worker"), "{text}");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&ssd).expect("dir").permissions().mode() & 0o777, 0o700);
}
