//! Buckets and queues on tokio's paused clock.

use super::*;

pub(super) fn class(name: &str, rate: f64, burst: f64, max_wait_ms: u64) -> ClassConfig {
    ClassConfig {
        name: name.into(),
        rule: MatchRule::default(),
        refill_tokens_per_s: rate,
        burst_tokens: burst,
        max_queued_requests: 100,
        max_queued_tokens: 1e9,
        max_wait_ms,
        expected_output_tokens: 0,
        borrow_idle: false,
        max_tenant_queues: 1024,
        slo: Default::default(),
    }
}

#[tokio::test(start_paused = true)]
async fn borrowing_idle_capacity_is_opt_in() {
    let mut lender = class("idle", 10.0, 10_000.0, 100);
    lender.borrow_idle = false;
    let mut borrower = class("busy", 10.0, 100.0, 100);
    borrower.borrow_idle = true;
    let plain = class("plain", 10.0, 100.0, 100);
    let a = Admission::new(vec![lender, borrower, plain]);
    a.admit(1, None, 100.0).await.expect("own burst").reconcile(100.0);
    a.admit(2, None, 100.0).await.expect("own burst").reconcile(100.0);
    // busy borrows from the idle class; plain (no borrowing) waits and times out.
    let p = a.admit(1, None, 500.0).await.expect("borrowed");
    assert_eq!(p.waited, Duration::ZERO);
    assert!(matches!(a.admit(2, None, 500.0).await, Err(Rejection::Timeout { .. })));
    // The idle class is no longer full: no further borrowing until it refills.
    assert!(matches!(a.admit(1, None, 500.0).await, Err(Rejection::Timeout { .. })));
}

#[tokio::test(start_paused = true)]
async fn over_budget_waits_then_times_out() {
    let a = Admission::new(vec![class("c", 100.0, 100.0, 5_000), class("slow", 1.0, 100.0, 5_000)]);
    let p = a.admit(0, None, 100.0).await.expect("first fits the burst");
    assert_eq!(p.waited, Duration::ZERO);
    let second = a.admit(0, None, 50.0).await.expect("waits for the refill");
    assert!(
        second.waited >= Duration::from_millis(499) && second.waited < Duration::from_millis(600),
        "{:?}",
        second.waited
    );
    a.admit(1, None, 100.0).await.expect("slow burst").reconcile(100.0);
    let t0 = Instant::now();
    match a.admit(1, None, 50.0).await {
        Err(Rejection::Timeout { class, retry_after_s }) => {
            assert_eq!(class, "slow");
            assert!(retry_after_s >= 40, "{retry_after_s}");
            assert!(t0.elapsed() >= Duration::from_secs(5));
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn classes_do_not_share_budgets() {
    let a = Admission::new(vec![class("short", 1000.0, 1000.0, 1_000), class("long", 10.0, 1000.0, 100)]);
    a.admit(1, None, 1000.0).await.expect("long burst").reconcile(1000.0);
    assert!(matches!(a.admit(1, None, 500.0).await, Err(Rejection::Timeout { .. })));
    for _ in 0..10 {
        let p = a.admit(0, None, 100.0).await.expect("short is unaffected");
        assert_eq!(p.waited, Duration::ZERO);
    }
}

#[tokio::test(start_paused = true)]
async fn a_request_bigger_than_the_burst_gets_in_when_the_bucket_is_full() {
    let a = Admission::new(vec![class("c", 1000.0, 1000.0, 60_000)]);
    a.admit(0, None, 600.0).await.expect("part of the burst").reconcile(600.0);
    let giant = a.admit(0, None, 50_000.0).await.expect("never starved");
    assert!(giant.waited >= Duration::from_millis(590));
    // Its debt delays the next request by ~50 s.
    let next = a.admit(0, None, 10.0).await.expect("after the debt");
    assert!(next.waited >= Duration::from_secs(49), "{:?}", next.waited);
}

#[tokio::test(start_paused = true)]
async fn tenants_take_turns_and_full_queues_reject() {
    let mut c = class("c", 100.0, 100.0, 60_000);
    c.max_queued_requests = 6;
    let a = Admission::new(vec![c]);
    a.admit(0, None, 100.0).await.expect("drain the burst").reconcile(100.0);
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for (i, tenant) in ["a", "a", "a", "a", "b"].iter().enumerate() {
        let (a, order) = (a.clone(), order.clone());
        tasks.push(tokio::spawn(async move {
            a.admit(0, Some(tenant), 100.0).await.expect("admitted").reconcile(100.0);
            order.lock().expect("order").push(format!("{tenant}{i}"));
        }));
        tokio::task::yield_now().await;
    }
    // Two more fit the queue (6), the third is refused at once.
    let (a2, a3) = (a.clone(), a.clone());
    tasks.push(tokio::spawn(async move {
        a2.admit(0, Some("c"), 100.0).await.expect("admitted").reconcile(100.0);
    }));
    tokio::task::yield_now().await;
    assert!(matches!(a3.admit(0, Some("d"), 1.0).await, Ok(_) | Err(Rejection::QueueFull { .. })));
    for t in tasks {
        t.await.expect("join");
    }
    let order = order.lock().expect("order").clone();
    let b_pos = order.iter().position(|x| x.starts_with('b')).expect("b served");
    assert_eq!(b_pos, 1, "tenant b does not wait behind all of a: {order:?}");
}

#[tokio::test(start_paused = true)]
async fn saturated_classes_complete_tokens_in_budget_ratio() {
    // 4:1 budgets, both classes offered far more than they can get for 60 virtual seconds.
    let a =
        Admission::new(vec![class("big", 4000.0, 4000.0, 120_000), class("small", 1000.0, 1000.0, 120_000)]);
    let done = Arc::new(Mutex::new([0f64; 2]));
    let stop = Instant::now() + Duration::from_secs(60);
    let mut tasks = Vec::new();
    for class in [0usize, 1] {
        for _ in 0..8 {
            let (a, done) = (a.clone(), done.clone());
            tasks.push(tokio::spawn(async move {
                while Instant::now() < stop {
                    if let Ok(p) = a.admit(class, None, 500.0).await {
                        if Instant::now() < stop {
                            done.lock().expect("done")[class] += 500.0;
                        }
                        p.reconcile(500.0);
                    }
                }
            }));
        }
    }
    for t in tasks {
        t.await.expect("join");
    }
    let [big, small] = *done.lock().expect("done");
    let ratio = big / small;
    assert!((ratio - 4.0).abs() <= 0.4, "ratio {ratio} ({big} vs {small})");
}

#[tokio::test(start_paused = true)]
async fn a_dropped_permit_refunds_its_whole_charge() {
    let a = Admission::new(vec![class("c", 1.0, 1000.0, 100)]);
    let p = a.admit(0, None, 1000.0).await.expect("whole burst");
    assert!(matches!(a.admit(0, None, 500.0).await, Err(Rejection::Timeout { .. })), "spent");
    drop(p); // an error answer, an upstream failure or a client abort: never reconciled
    let q = a.admit(0, None, 1000.0).await.expect("refunded");
    assert_eq!(q.waited, Duration::ZERO);
    // A reconciled permit is not refunded again when it goes away.
    q.reconcile(1000.0);
    assert!(matches!(a.admit(0, None, 500.0).await, Err(Rejection::Timeout { .. })));
}

#[tokio::test(start_paused = true)]
async fn refunds_follow_the_class_name_across_a_reorder() {
    let a = Admission::new(vec![class("x", 1.0, 1000.0, 100), class("y", 1.0, 1000.0, 100)]);
    let p = a.admit(0, None, 1000.0).await.expect("x's burst");
    // PUT /budgets puts y first: x is now index 1.
    a.set_classes(vec![class("y", 1.0, 1000.0, 100), class("x", 1.0, 1000.0, 100)]);
    a.admit(0, None, 1000.0).await.expect("y untouched").reconcile(1000.0);
    drop(p);
    let again = a.admit(1, None, 1000.0).await.expect("x got its refund");
    assert_eq!(again.waited, Duration::ZERO);
    assert!(
        matches!(a.admit(0, None, 10.0).await, Err(Rejection::Timeout { .. })),
        "y (now first) did not get x's refund"
    );
    // A permit of a class that no longer exists refunds nowhere (and does not panic).
    a.set_classes(vec![class("y", 1.0, 1000.0, 100)]);
    drop(again);
}

#[tokio::test(start_paused = true)]
async fn tenant_queues_are_bounded() {
    let mut c = class("c", 1.0, 10.0, 50);
    c.max_tenant_queues = 4;
    c.max_queued_requests = 1000;
    let a = Admission::new(vec![c]);
    a.admit(0, None, 10.0).await.expect("burst").reconcile(10.0);
    let mut tasks = Vec::new();
    for i in 0..200 {
        let a = a.clone();
        tasks.push(tokio::spawn(async move { a.admit(0, Some(&format!("t{i}")), 5.0).await.is_ok() }));
    }
    for _ in 0..1000 {
        if a.lock().classes[0].queued_requests == 200 {
            break;
        }
        tokio::task::yield_now().await;
    }
    {
        let inner = a.lock();
        assert_eq!(inner.classes[0].queued_requests, 200);
        assert!(
            inner.classes[0].queues.len() <= 5,
            "4 tenants + the overflow queue: {}",
            inner.classes[0].queues.len()
        );
    }
    for t in tasks {
        t.await.expect("join");
    }
    assert!(a.lock().classes[0].queues.is_empty(), "timed-out waiters leave no queue behind");
}

#[tokio::test(start_paused = true)]
async fn a_waiter_whose_client_left_frees_its_queue_slot_at_once() {
    let mut c = class("c", 1.0, 100.0, 60_000);
    c.max_queued_requests = 1;
    let a = Admission::new(vec![c]);
    let _spent = a.admit(0, None, 100.0).await.expect("burst");
    // A request waits (the only queue slot) and its client goes away: the future is dropped.
    let gone = tokio::time::timeout(Duration::from_millis(10), a.admit(0, None, 50.0)).await;
    assert!(gone.is_err(), "it was waiting");
    assert_eq!(a.lock().classes[0].queued_requests, 0, "the slot is free again");
    // So the next request can queue (and is served once the budget refills), not 429 queue_full.
    let next = a.admit(0, None, 50.0).await.expect("queued, then admitted");
    assert!(next.waited >= Duration::from_secs(49));
}

#[tokio::test(start_paused = true)]
async fn with_rate_scale_zero_only_credits_refill_and_they_serve_the_queue() {
    let a = Admission::new(vec![class("c", 1000.0, 1000.0, 5_000)]);
    a.set_rate_scale(0.0);
    a.credit("c", -1000.0);
    let b = &a.budgets()[0];
    assert_eq!((b.name.as_str(), b.level, b.queued_tokens), ("c", 0.0, 0.0));
    let waiter = {
        let a = a.clone();
        tokio::spawn(async move { a.admit(0, None, 300.0).await })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Two seconds at a configured 1,000 tokens/s refilled nothing: only credits do.
    let b = &a.budgets()[0];
    assert_eq!((b.level, b.queued_tokens, b.head_cost), (0.0, 300.0, 300.0));
    assert!(!waiter.is_finished());
    a.credit("c", 300.0);
    let p = waiter.await.expect("task").expect("served by the credit");
    assert!(p.waited >= Duration::from_secs(2));
    p.reconcile(100.0);
    assert_eq!(a.budgets()[0].level, 200.0, "the refund stays in the local bucket");
    // Back to scale 1 (Redis lost, one replica): refills by the clock again, capped at the burst.
    a.set_rate_scale(1.0);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(a.budgets()[0].level, 1000.0);
}
