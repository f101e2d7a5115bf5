//! The host agent (`kemari-agent`): one per host.
//!
//! Its lease is kept alive by a thread of its own ([`lease`]), however long
//! a round takes. Every poll (half a second), and at once when the registry
//! changes (an etcd watch), it
//! 1. keeps its host registered (`PREFIX/_fleet/hosts/NAME`, bound to its
//!    lease: a dead host disappears within the TTL);
//! 2. asks each kemari whose API socket lies in its VM folder for its
//!    fault-tolerance status, and keeps the record of each VM it runs as
//!    primary (`PREFIX/_fleet/vms/ID`: primary, standby, state, epoch,
//!    since when, last failover);
//! 3. re-protects: for a VM that runs unprotected elsewhere (`unprotected`,
//!    `degraded`, `failed_over`) and has no standby claim, the best free
//!    host ([`crate::rank`]) claims it (create-if-absent of
//!    `PREFIX/_fleet/standby/ID`, bound to its lease), starts `kemari
//!    --ft-standby …` here and publishes its address in the claim; the
//!    primary's agent then runs `ft start` towards it. A lower-ranked host
//!    claims only once the VM has waited [`CLAIM_PATIENCE`] per rank.
//!
//! A failed `ft start` drops the claim (another host is chosen) and the
//! next `ft start` of that VM waits, longer after each failure in a row
//! ([`backoff`]); a standby
//! that ends drops its own; after a failover the new primary's agent drops
//! the claim that named its host, and the VM needs a standby again.

pub mod backoff;
pub mod http;
pub mod launch;
pub mod lease;
pub mod local;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ft::fence::etcd::EtcdSpec;
use kemari_api::{ApiRequest, FtStartRequest};
use tokio::task::JoinHandle;

use self::backoff::Backoff;
use self::launch::{Launched, StandbyTemplate};
use self::lease::Keeper;
use self::local::{FtView, Local, Seen};
use crate::record::{needs_standby, Claim, Failover, HostRecord, VmRecord};
use crate::store::{Snapshot, Store};
use crate::{now_unix, FleetError};

/// How often the agent looks.
pub const POLL: Duration = Duration::from_millis(500);
/// The shortest time between two rounds.
const MIN_GAP: Duration = Duration::from_millis(100);
/// How long a VM waits for the host ranked before this one, per rank.
pub const CLAIM_PATIENCE: Duration = Duration::from_secs(5);
/// A VM record is rewritten at least this often while it runs (its epoch
/// and sync rate move).
const REFRESH: Duration = Duration::from_secs(2);
/// A step of a round that takes this long is logged (at INFO).
const SLOW_STEP: Duration = Duration::from_secs(1);

/// How the agent was started.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// `--etcd etcd://…`, as given (the standbys' `--ft-fence`).
    pub etcd: String,
    /// Its parsed form.
    pub spec: EtcdSpec,
    /// This host's name in the fleet.
    pub host: String,
    /// The address this host's standbys listen on.
    pub address: String,
    /// Where the VMs' API sockets are (`ID.sock`).
    pub vm_dir: PathBuf,
    /// The migration key (the same file on every host).
    pub key_file: PathBuf,
    /// The kemari binary for standbys.
    pub kemari: PathBuf,
    /// Standbys this host may run.
    pub slots: u32,
    /// Extra arguments for each standby (`{id}` replaced by the VM's id).
    pub standby_args: Vec<String>,
    /// The sync link's peer timeout for `ft start`, ms (kemari's default
    /// if unset).
    pub ft_timeout_ms: Option<u64>,
    /// Serve the fleet page here (`ADDR:PORT`).
    pub http: Option<String>,
}

/// The id a host publishes for its migration key: a keyed hash of the
/// file's contents, so hosts with the same key recognize each other
/// without revealing it.
pub fn key_id(key: &[u8]) -> String {
    let h = blake3::derive_key("kemari fleet 2026-11 migration key id", key);
    h[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// `MemAvailable` in bytes (0 if unknown).
fn free_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemAvailable:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// An `ft start` running towards a claimed standby.
struct Protecting {
    task: JoinHandle<Result<(), String>>,
    claim_revision: i64,
    peer: String,
}

struct Agent {
    cfg: AgentConfig,
    store: Store,
    key_id: String,
    template: StandbyTemplate,
    /// Keeps the lease alive.
    keeper: Keeper,
    /// The lease this host's keys are bound to (the keeper's, as of the
    /// last round).
    lease: i64,
    /// When the host record was last written.
    host_written: Instant,
    registered_since: u64,
    http_addr: Option<String>,
    shown: http::Shown,
    /// Standbys started here, by VM id.
    launched: HashMap<String, Launched>,
    /// Standbys started here that took over: VMs now, reaped when they end.
    adopted: HashMap<String, std::process::Child>,
    /// `ft start`s running, by VM id.
    protecting: HashMap<String, Protecting>,
    /// VMs whose last `ft start`s failed: when the next may start.
    backoff: HashMap<String, Backoff>,
    /// Since when a VM elsewhere has waited for a standby (as seen here).
    waiting: HashMap<String, Instant>,
    /// When each local record was last written.
    written: HashMap<String, Instant>,
    /// VMs that ran here as primaries, and since when each has been gone
    /// (None: it runs).
    ran_here: HashMap<String, Option<Instant>>,
    /// Standbys started here that ended, whose claims are still to drop.
    ended: HashSet<String>,
}

/// Runs the agent until it fails to start (the error) or forever.
/// Connects to etcd and takes this host's lease. An agent is a daemon
/// that may start with its etcd cluster (or while etcd is loaded): while
/// etcd does not answer it tries again, paced as failing `ft start`s are
/// ([`backoff`]); any other error (a certificate file that cannot be read,
/// a bad address) is the operator's to fix and ends the agent.
async fn join_registry(spec: &EtcdSpec) -> Result<(Store, i64), FleetError> {
    let mut pacing = Backoff::default();
    loop {
        let attempt = async {
            let store = Store::connect(spec).await?;
            let lease = store.grant(spec.ttl).await?;
            Ok::<_, FleetError>((store, lease))
        };
        match attempt.await {
            Ok(joined) => return Ok(joined),
            Err(e @ FleetError::Etcd { .. }) => {
                let pause = pacing.failed(Instant::now());
                tracing::warn!(
                    error = %e,
                    failures = pacing.failures(),
                    retry_in_ms = pause.as_millis() as u64,
                    "fleet agent: etcd did not answer; trying again"
                );
                tokio::time::sleep(pause).await;
            }
            Err(e) => return Err(e),
        }
    }
}

pub async fn run(cfg: AgentConfig) -> Result<(), FleetError> {
    let key = std::fs::read(&cfg.key_file).map_err(|source| FleetError::File {
        what: "migration key file",
        path: cfg.key_file.display().to_string(),
        source,
    })?;
    std::fs::create_dir_all(&cfg.vm_dir).map_err(|source| FleetError::File {
        what: "VM folder",
        path: cfg.vm_dir.display().to_string(),
        source,
    })?;
    let (store, lease) = join_registry(&cfg.spec).await?;
    let keeper = Keeper::start(&cfg.spec, lease)?;
    let shown = http::Shown::default();
    let http_addr = match &cfg.http {
        Some(addr) => Some(http::serve(addr, cfg.host.clone(), shown.clone())?),
        None => None,
    };
    let template = StandbyTemplate {
        kemari: cfg.kemari.clone(),
        address: cfg.address.clone(),
        key_file: cfg.key_file.clone(),
        fence: cfg.etcd.clone(),
        extra: cfg.standby_args.clone(),
        dir: cfg.vm_dir.clone(),
    };
    let mut agent = Agent {
        key_id: key_id(&key),
        store,
        template,
        keeper,
        lease,
        host_written: Instant::now(),
        registered_since: now_unix(),
        http_addr,
        shown,
        launched: HashMap::new(),
        adopted: HashMap::new(),
        protecting: HashMap::new(),
        backoff: HashMap::new(),
        waiting: HashMap::new(),
        written: HashMap::new(),
        ran_here: HashMap::new(),
        ended: HashSet::new(),
        cfg,
    };
    agent.register().await?;
    tracing::info!(
        host = agent.cfg.host,
        address = agent.cfg.address,
        http = agent.http_addr.as_deref().unwrap_or("-"),
        slots = agent.cfg.slots,
        "fleet agent: registered"
    );
    // A change in the registry (a claim, its standby's address, a record)
    // starts the next round at once; the local VMMs are asked every POLL.
    let mut watch = None;
    loop {
        if let Err(e) = agent.round().await {
            tracing::warn!(error = %e, "fleet agent: this round failed; trying again");
        }
        // A round that ended, even failed (etcd away): the loop is alive.
        agent.keeper.alive();
        if watch.is_none() {
            watch = match agent.store.watch().await {
                Ok(w) => Some(w),
                Err(e) => {
                    tracing::debug!(error = %e, "fleet agent: cannot watch the registry; polling");
                    None
                }
            };
        }
        let rest = tokio::time::sleep(POLL);
        match &mut watch {
            Some(stream) => {
                tokio::select! {
                    _ = rest => {}
                    changed = stream.message() => {
                        if !matches!(changed, Ok(Some(_))) {
                            watch = None;
                        }
                        // Changes come in bursts (a round writes too).
                        tokio::time::sleep(MIN_GAP).await;
                    }
                }
            }
            None => rest.await,
        }
    }
}

impl Agent {
    fn me(&self) -> &str {
        &self.cfg.host
    }

    fn host_record(&self) -> HostRecord {
        HostRecord {
            name: self.cfg.host.clone(),
            address: self.cfg.address.clone(),
            http: self.http_addr.clone(),
            slots: self.cfg.slots,
            standbys: self.launched.len() as u32,
            free_memory_bytes: free_memory(),
            key_id: self.key_id.clone(),
            since_unix: self.registered_since,
        }
    }

    async fn register(&mut self) -> Result<(), FleetError> {
        self.store.put_host(&self.host_record(), self.lease).await
    }

    /// Follows the keeper's lease: under a new one (etcd let the last one
    /// expire) the host and its standbys' claims are written again; the
    /// host record is rewritten every TTL/3 (free memory, standbys).
    async fn follow_lease(&mut self) -> Result<(), FleetError> {
        let lease = self.keeper.lease();
        if lease != self.lease {
            tracing::warn!(
                host = self.cfg.host,
                old = self.lease,
                new = lease,
                "fleet agent: a new lease; registering the host and its claims again"
            );
            // Followed only once all is written (a failure: again next round).
            self.store.put_host(&self.host_record(), lease).await?;
            self.host_written = Instant::now();
            let me = self.cfg.host.clone();
            for (id, l) in &self.launched {
                let claim = Claim {
                    host: me.clone(),
                    peer: l.published.then(|| l.peer.clone()),
                    since_unix: now_unix(),
                };
                self.store.claim(id, &claim, lease).await?;
            }
            self.lease = lease;
            return Ok(());
        }
        if self.host_written.elapsed() >= self.cfg.spec.ttl / 3 {
            self.register().await?;
            self.host_written = Instant::now();
        }
        Ok(())
    }

    /// A step of a round ended: the loop is alive; a long step is logged
    /// (a round's steps run one after the other: a long one delays the
    /// claims and the protections of every VM).
    fn stepped(&self, step: &'static str, started: Instant) {
        self.keeper.alive();
        let took = started.elapsed();
        if took >= SLOW_STEP {
            tracing::info!(
                step,
                took_ms = took.as_millis() as u64,
                "fleet agent: a step of the round took long"
            );
        }
    }

    async fn round(&mut self) -> Result<(), FleetError> {
        tracing::trace!("fleet agent: round");
        // First what needs no etcd: children that ended are reaped even
        // while etcd is out of reach.
        self.reap_children();
        let t = Instant::now();
        self.follow_lease().await?;
        self.stepped("lease", t);
        let t = Instant::now();
        let dir = self.cfg.vm_dir.clone();
        let locals = tokio::task::spawn_blocking(move || local::scan(&dir))
            .await
            .unwrap_or_default();
        self.stepped("asking the local VMMs", t);
        let t = Instant::now();
        let snap = self.store.snapshot().await?;
        self.drop_ended_claims(&snap).await?;
        self.stepped("reading the registry", t);
        let mut here = HashSet::new();
        for l in &locals {
            let t = Instant::now();
            here.insert(l.id.clone());
            self.local_vm(l, &snap).await?;
            self.stepped("a local VM", t);
        }
        // Primaries that ended (a clean end removes the socket too).
        let running: HashSet<&String> = locals
            .iter()
            .filter(|l| !matches!(l.seen, Seen::Gone))
            .map(|l| &l.id)
            .collect();
        let ended: Vec<String> = self
            .ran_here
            .keys()
            .filter(|id| !running.contains(id) && !self.adopted.contains_key(*id))
            .cloned()
            .collect();
        let t = Instant::now();
        for id in ended {
            self.vm_gone(&id, &snap).await?;
        }
        self.finish_protections().await?;
        self.stepped("ended VMs and protections", t);
        let t = Instant::now();
        self.claim_for_others(&snap, &here).await?;
        self.stepped("claims", t);
        // The page shows the registry as it is now.
        let t = Instant::now();
        let snap = self.store.snapshot().await?;
        *self.shown.lock().unwrap_or_else(|p| p.into_inner()) = Some(crate::view::fleet(&snap));
        self.stepped("the page", t);
        Ok(())
    }

    /// Standbys and VMs started here that ended: reaped (their pid files
    /// go); a standby's claim goes next ([`Self::drop_ended_claims`]).
    fn reap_children(&mut self) {
        let mut ended = Vec::new();
        for (id, l) in &mut self.launched {
            if let Ok(Some(st)) = l.child.try_wait() {
                tracing::info!(vm = id, status = %st, "fleet agent: a standby ended");
                ended.push(id.clone());
            }
        }
        let mut reaped = Vec::new();
        for (id, c) in &mut self.adopted {
            if let Ok(Some(st)) = c.try_wait() {
                tracing::info!(vm = id, status = %st, "fleet agent: a VM started here as a standby ended");
                reaped.push(id.clone());
            }
        }
        for id in reaped {
            self.adopted.remove(&id);
            let _ = std::fs::remove_file(launch::pid_file(&self.cfg.vm_dir, &id));
        }
        for id in ended {
            self.launched.remove(&id);
            let _ = std::fs::remove_file(launch::pid_file(&self.cfg.vm_dir, &id));
            self.ended.insert(id);
        }
    }

    /// The claims of standbys that ended here go.
    async fn drop_ended_claims(&mut self, snap: &Snapshot) -> Result<(), FleetError> {
        for id in self.ended.clone() {
            if let Some(c) = snap.claims.get(&id) {
                if c.value.host == self.cfg.host && !self.launched.contains_key(&id) {
                    self.store.drop_claim(&id, c.revision).await?;
                }
            }
            self.ended.remove(&id);
        }
        Ok(())
    }

    async fn local_vm(&mut self, l: &Local, snap: &Snapshot) -> Result<(), FleetError> {
        match &l.seen {
            Seen::Gone => {
                // A copy killed here left its socket.
                if !self.launched.contains_key(&l.id) && !self.adopted.contains_key(&l.id) {
                    let _ = std::fs::remove_file(&l.socket);
                }
                Ok(())
            }
            Seen::Silent(why) => {
                tracing::debug!(vm = l.id, why, "fleet agent: a VMM did not answer");
                Ok(())
            }
            Seen::Ft(ft) if ft.is_standby() => self.standby_here(&l.id, ft, snap).await,
            // A standby started here that has not taken over: still
            // starting (its API answers before it listens for its primary:
            // `none`, `unprotected`), or ending (told to stand down).
            Seen::Ft(ft) if self.launched.contains_key(&l.id) && !ft.took_over() => {
                tracing::debug!(
                    vm = l.id,
                    state = ft.state,
                    "fleet agent: the standby started here does not wait yet"
                );
                Ok(())
            }
            Seen::Ft(ft) => {
                self.ran_here.insert(l.id.clone(), None);
                self.primary_here(&l.id, &l.socket, ft, snap).await
            }
        }
    }

    /// A standby here: publish its address once it waits; end it if the
    /// VM went to another standby.
    async fn standby_here(
        &mut self,
        id: &str,
        ft: &FtView,
        snap: &Snapshot,
    ) -> Result<(), FleetError> {
        let Some(l) = self.launched.get_mut(id) else {
            return Ok(());
        };
        let claim = snap.claims.get(id);
        let mine = claim.filter(|c| c.value.host == self.cfg.host);
        match mine {
            Some(c) if !l.published && ft.state == "standby" => {
                let updated = Claim {
                    peer: Some(l.peer.clone()),
                    ..c.value.clone()
                };
                if self
                    .store
                    .update_claim(id, c.revision, &updated, self.lease)
                    .await?
                {
                    l.published = true;
                    tracing::info!(vm = id, peer = l.peer, "fleet agent: standby ready");
                }
            }
            Some(_) => {}
            None => {
                let vm_needs = snap.vms.get(id).is_some_and(|v| v.value.needs_standby());
                if ft.state == "standby" && (claim.is_some() || vm_needs) {
                    tracing::info!(
                        vm = id,
                        "fleet agent: the claim went elsewhere; ending this standby"
                    );
                    // SAFETY: kill takes no memory; the pid is our child's.
                    unsafe { libc::kill(l.child.id() as i32, libc::SIGTERM) };
                }
            }
        }
        Ok(())
    }

    /// A VM that runs here: keep its record; get it a standby.
    async fn primary_here(
        &mut self,
        id: &str,
        socket: &Path,
        ft: &FtView,
        snap: &Snapshot,
    ) -> Result<(), FleetError> {
        // A standby that failed over is an ordinary VM now.
        if let Some(l) = self.launched.remove(id) {
            tracing::info!(
                vm = id,
                state = ft.state,
                "fleet agent: the standby started here took over; the VM runs here"
            );
            self.adopted.insert(id.to_owned(), l.child);
            self.register().await?;
        }
        let claim = snap.claims.get(id);
        // A claim naming this host is the one it held as the standby.
        if let Some(c) = claim.filter(|c| c.value.host == self.cfg.host) {
            if self.store.drop_claim(id, c.revision).await? {
                tracing::info!(vm = id, "fleet agent: dropped this host's standby claim");
            }
            return Ok(());
        }
        let old = snap.vms.get(id);
        let record = self.record(id, ft, old.map(|v| &v.value), claim.map(|c| &c.value));
        let due = self.written.get(id).is_none_or(|t| t.elapsed() >= REFRESH);
        let changed = old.is_none_or(|o| {
            let o = &o.value;
            (&o.primary, &o.standby, &o.state) != (&record.primary, &record.standby, &record.state)
        });
        if changed || due {
            let revision = old.map_or(0, |o| o.revision);
            if self.store.swap_vm(revision, &record).await? {
                self.written.insert(id.to_owned(), Instant::now());
                if changed {
                    tracing::info!(
                        vm = id,
                        state = record.state,
                        standby = record.standby.as_deref().unwrap_or("-"),
                        "fleet agent: VM record"
                    );
                }
            }
        }
        if needs_standby(&ft.state) && !self.protecting.contains_key(id) {
            if let Some(c) = claim {
                if let Some(peer) = &c.value.peer {
                    if self.backoff.get(id).is_none_or(|b| b.ready(Instant::now())) {
                        self.protect(id, socket, peer, c.revision);
                    } else {
                        tracing::debug!(
                            vm = id,
                            peer,
                            "fleet agent: waiting before the next ft start"
                        );
                    }
                }
            }
        }
        Ok(())
    }

    fn record(
        &self,
        id: &str,
        ft: &FtView,
        old: Option<&VmRecord>,
        claim: Option<&Claim>,
    ) -> VmRecord {
        let now = now_unix();
        let me = self.me().to_owned();
        let (since, failovers, last_failover) = match old {
            Some(o) if o.primary == me => (o.since_unix, o.failovers, o.last_failover.clone()),
            Some(o) if ft.failovers > 0 || ft.state == "failed_over" => (
                now,
                o.failovers + 1,
                Some(Failover {
                    at_unix: now,
                    from: o.primary.clone(),
                    to: me.clone(),
                    failover_ms: ft.failover_ms,
                }),
            ),
            Some(o) => (now, o.failovers, o.last_failover.clone()),
            None => (now, 0, None),
        };
        let standby = match (ft.state.as_str(), claim) {
            ("syncing" | "protected", Some(c)) => Some(c.host.clone()),
            ("syncing" | "protected", None) => Some(ft.peer.clone()),
            _ => None,
        };
        VmRecord {
            id: id.to_owned(),
            primary: me,
            standby,
            state: ft.state.clone(),
            epoch: ft.epoch,
            syncs_per_s: ft.syncs_per_s,
            memory_bytes: ft.memory_bytes.or(old.and_then(|o| o.memory_bytes)),
            since_unix: since,
            failovers,
            last_failover,
            updated_unix: now,
        }
    }

    /// `ft start` towards `peer`, on a blocking thread.
    fn protect(&mut self, id: &str, socket: &Path, peer: &str, claim_revision: i64) {
        tracing::info!(vm = id, peer, "fleet agent: protecting the VM");
        let request = ApiRequest::FtStart(FtStartRequest {
            peer: peer.to_owned(),
            key_file: std::path::absolute(&self.cfg.key_file)
                .unwrap_or_else(|_| self.cfg.key_file.clone()),
            periodic_ms: None,
            heartbeat_ms: None,
            timeout_ms: self.cfg.ft_timeout_ms,
            keep_writable_pages: None,
            epochs_in_flight: None,
            plaintext: false,
        });
        let socket = socket.to_path_buf();
        let task = tokio::task::spawn_blocking(move || {
            kemari_api::client::run_operation(&socket, &request, |_| {})
                .map(|_| ())
                .map_err(|e| e.to_string())
        });
        self.protecting.insert(
            id.to_owned(),
            Protecting {
                task,
                claim_revision,
                peer: peer.to_owned(),
            },
        );
    }

    /// `ft start`s that ended: a failed one gives the claim up, so that
    /// another host is chosen.
    async fn finish_protections(&mut self) -> Result<(), FleetError> {
        let done: Vec<String> = self
            .protecting
            .iter()
            .filter(|(_, p)| p.task.is_finished())
            .map(|(id, _)| id.clone())
            .collect();
        for id in done {
            let Some(p) = self.protecting.remove(&id) else {
                continue;
            };
            let result = p
                .task
                .await
                .unwrap_or_else(|e| Err(format!("the ft start task failed: {e}")));
            match result {
                Ok(()) => {
                    self.backoff.remove(&id);
                    tracing::info!(vm = id, peer = p.peer, "fleet agent: the VM is protected")
                }
                Err(why) => {
                    let b = self.backoff.entry(id.clone()).or_default();
                    let pause = b.failed(Instant::now());
                    tracing::warn!(
                        vm = id,
                        peer = p.peer,
                        error = why,
                        failures = b.failures(),
                        retry_in_ms = pause.as_millis() as u64,
                        capped = pause == backoff::CAP,
                        "fleet agent: ft start failed; giving the claim up"
                    );
                    self.store.drop_claim(&id, p.claim_revision).await?;
                }
            }
        }
        Ok(())
    }

    /// A VM that ran here as primary and no longer does. Its record, if
    /// it still names this host, says `down` once no copy has held its
    /// fence key for two TTLs (a standby that took over would have
    /// rewritten the record).
    async fn vm_gone(&mut self, id: &str, snap: &Snapshot) -> Result<(), FleetError> {
        let rec = match snap.vms.get(id) {
            Some(r) if r.value.primary == self.cfg.host && r.value.state != "down" => r,
            _ => {
                self.ran_here.remove(id);
                self.backoff.remove(id);
                return Ok(());
            }
        };
        let since = *self
            .ran_here
            .entry(id.to_owned())
            .or_default()
            .get_or_insert_with(Instant::now);
        if since.elapsed() < 2 * self.cfg.spec.ttl || self.store.fence_held(id).await? {
            return Ok(());
        }
        let down = VmRecord {
            state: "down".into(),
            standby: None,
            syncs_per_s: 0.0,
            updated_unix: now_unix(),
            ..rec.value.clone()
        };
        if self.store.swap_vm(rec.revision, &down).await? {
            tracing::info!(
                vm = id,
                "fleet agent: the VM ran here and no copy runs it now: down"
            );
        }
        self.ran_here.remove(id);
        self.backoff.remove(id);
        Ok(())
    }

    /// Claims VMs that run unprotected elsewhere, when this host's turn
    /// has come, and starts their standbys.
    async fn claim_for_others(
        &mut self,
        snap: &Snapshot,
        here: &HashSet<String>,
    ) -> Result<(), FleetError> {
        let hosts = snap.host_list();
        let mut still_waiting = HashSet::new();
        for (id, v) in &snap.vms {
            let v = &v.value;
            if v.primary == self.cfg.host
                || !v.needs_standby()
                || snap.claims.contains_key(id)
                || here.contains(id)
                || self.launched.contains_key(id)
            {
                continue;
            }
            still_waiting.insert(id.clone());
            let waited = self
                .waiting
                .entry(id.clone())
                .or_insert_with(Instant::now)
                .elapsed();
            let Some(rank) = crate::rank::position(&hosts, v, &self.cfg.host) else {
                tracing::debug!(vm = id, "fleet agent: this host may not protect the VM");
                continue;
            };
            tracing::debug!(
                vm = id,
                rank,
                waited_ms = waited.as_millis() as u64,
                "fleet agent: the VM needs a standby"
            );
            if waited < CLAIM_PATIENCE * rank as u32 {
                continue;
            }
            let claim = Claim {
                host: self.cfg.host.clone(),
                peer: None,
                since_unix: now_unix(),
            };
            if !self.store.claim(id, &claim, self.lease).await? {
                continue;
            }
            match self.template.start(id) {
                Ok(l) => {
                    tracing::info!(
                        vm = id,
                        primary = v.primary,
                        peer = l.peer,
                        rank,
                        "fleet agent: claimed the VM; standby started"
                    );
                    self.launched.insert(id.clone(), l);
                    self.register().await?;
                }
                Err(e) => {
                    tracing::error!(vm = id, error = %e, "fleet agent: cannot start a standby; giving the claim up");
                    if let Some(c) = self.store.snapshot().await?.claims.get(id) {
                        if c.value.host == self.cfg.host {
                            self.store.drop_claim(id, c.revision).await?;
                        }
                    }
                }
            }
        }
        self.waiting.retain(|id, _| still_waiting.contains(id));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_id_names_the_key_without_showing_it() {
        let a = key_id(b"secret one\n");
        assert_eq!(a.len(), 16);
        assert_eq!(a, key_id(b"secret one\n"));
        assert_ne!(a, key_id(b"secret two\n"));
        assert!(free_memory() > 0);
    }
}
