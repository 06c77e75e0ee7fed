//! A cache of recent sessions keyed by their token ids, for KV reuse across requests.
//!
//! After a request, its session (prompt plus completion, all but the last sampled token)
//! is kept. A later request whose prompt shares a prefix with a kept session starts
//! from a byte-exact copy of that session's cache cut to the shared prefix (a tail
//! eviction, exact: nothing after it is renumbered) and prefills only the rest, so the
//! output is the same as a cold run (rungs R14 and R2a: prefix clone == recompute,
//! decode == prefill). Entries are whole sessions, bounded by a byte budget
//! ([`fak_kv::KvCache::bytes_used`]) with least-recently-used eviction.
//!
//! The sessions sit in a prefix tree (a trie) keyed by token ids, one node per token.
//! No kept session is a prefix of another (a longer one covers a shorter one), so
//! sessions end exactly at the leaves, and every node has at least one session below
//! it. A lookup walks the prompt down the tree: the deepest node it reaches is the
//! longest prefix the prompt shares with any kept session, including one that diverges
//! from the prompt after that node. Each node records the most recent use below it, so
//! the most recently used of the sessions there is found without searching the subtree:
//! a lookup costs O(prompt tokens), whatever the number of sessions kept.
//!
//! A kept session's cache is frozen ([`fak_kv::KvCache::freeze`]): a request that
//! starts from it reads the shared prefix in place and holds only its own entries, and
//! when that request's session is kept in turn, its cache continues the same shared
//! blocks. So conversations on one system prompt hold its KV once
//! ([`PrefixCache::bytes_held`]); a revocation or eviction in one copies what it
//! changes and leaves the others' bits alone.

use crate::{Revocation, RevokeReport};
use fak_kv::Session;
use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

/// Index of a node in [`Trie::nodes`].
type NodeId = usize;

/// The root: the empty prefix.
const ROOT: NodeId = 0;

/// A kept value and its bookkeeping.
struct Entry<T> {
    value: T,
    /// Its size against the budget, bytes.
    bytes: usize,
    /// The tick of its last insert or hit (unique among the entries held).
    last_used: u64,
}

struct Node<T> {
    /// The node above (the root's is itself).
    parent: NodeId,
    /// The token on the edge from the parent (unused at the root).
    token: u32,
    /// Children by token, sorted by token.
    children: Vec<(u32, NodeId)>,
    /// The entry whose ids end here; only leaves hold one.
    entry: Option<Entry<T>>,
    /// The largest `last_used` of the entries in this subtree (0 when it has none).
    newest: u64,
}

impl<T> Node<T> {
    fn new(parent: NodeId, token: u32) -> Self {
        Node {
            parent,
            token,
            children: Vec::new(),
            entry: None,
            newest: 0,
        }
    }

    fn child(&self, token: u32) -> Option<NodeId> {
        self.children
            .binary_search_by_key(&token, |&(t, _)| t)
            .ok()
            .map(|i| self.children[i].1)
    }
}

/// A token-id trie of values with sizes: longest-prefix lookup, prefix-covered entries
/// dropped, least-recently-used eviction within a byte budget. [`PrefixCache`] over
/// sessions; generic so that its bookkeeping is tested without a model.
struct Trie<T> {
    /// Nodes by id; freed ones are listed in `free` and reused.
    nodes: Vec<Node<T>>,
    free: Vec<NodeId>,
    /// The leaf of each entry by its `last_used` tick: oldest first.
    by_use: BTreeMap<u64, NodeId>,
    /// Sum of the entries' `bytes`.
    bytes: usize,
    budget_bytes: usize,
    tick: u64,
}

impl<T> Trie<T> {
    fn new(budget_bytes: usize) -> Self {
        Trie {
            nodes: vec![Node::new(ROOT, 0)],
            free: Vec::new(),
            by_use: BTreeMap::new(),
            bytes: 0,
            budget_bytes,
            tick: 0,
        }
    }

    fn len(&self) -> usize {
        self.by_use.len()
    }

    /// The deepest node on `ids`' path, and its depth (tokens matched).
    fn walk(&self, ids: &[u32]) -> (NodeId, usize) {
        let mut n = ROOT;
        for (depth, &t) in ids.iter().enumerate() {
            match self.nodes[n].child(t) {
                Some(c) => n = c,
                None => return (n, depth),
            }
        }
        (n, ids.len())
    }

    /// The leaf of the most recently used entry in `n`'s subtree (which has one).
    fn newest_leaf(&self, n: NodeId) -> NodeId {
        self.by_use[&self.nodes[n].newest]
    }

    /// Marks the entry at `leaf` used now (at the current tick).
    fn touch(&mut self, leaf: NodeId) {
        let tick = self.tick;
        let e = self.nodes[leaf]
            .entry
            .as_mut()
            .expect("entries sit at leaves");
        self.by_use.remove(&e.last_used);
        e.last_used = tick;
        self.by_use.insert(tick, leaf);
        self.raise_newest(leaf, tick);
    }

    /// Sets `newest = tick` from `n` up to the root (`tick` is the newest of all).
    fn raise_newest(&mut self, mut n: NodeId, tick: u64) {
        loop {
            self.nodes[n].newest = tick;
            if n == ROOT {
                break;
            }
            n = self.nodes[n].parent;
        }
    }

    /// The longest prefix `prompt[..limit]` shares with a kept entry, and the most
    /// recently used entry sharing it (marked used); `None` when it is no longer than
    /// `floor` tokens (the partition's tag, see [`Partition`]; 0: nothing shared).
    fn lookup(&mut self, prompt: &[u32], limit: usize, floor: usize) -> Option<(&T, usize)> {
        let (n, depth) = self.walk(&prompt[..limit.min(prompt.len())]);
        if depth <= floor {
            return None;
        }
        self.tick += 1;
        let leaf = self.newest_leaf(n);
        self.touch(leaf);
        let e = self.nodes[leaf].entry.as_ref()?;
        Some((&e.value, depth))
    }

    /// Keeps `value` under `ids` (see [`PrefixCache::insert`]).
    fn insert(&mut self, ids: &[u32], value: T, bytes: usize) {
        self.tick += 1;
        if ids.is_empty() || bytes > self.budget_bytes {
            return;
        }
        let (mut n, depth) = self.walk(ids);
        if depth == ids.len() {
            // `ids` is a prefix of (or equal to) the entries below `n`.
            let leaf = self.newest_leaf(n);
            self.touch(leaf);
            return;
        }
        if let Some(old) = self.nodes[n].entry.take() {
            // A kept entry is a prefix of `ids`: covered, it goes. Its node stays, as
            // the path to the new leaf.
            self.by_use.remove(&old.last_used);
            self.bytes -= old.bytes;
        }
        for &t in &ids[depth..] {
            let c = self.alloc(Node::new(n, t));
            let at = self.nodes[n]
                .children
                .binary_search_by_key(&t, |&(t, _)| t)
                .unwrap_err();
            self.nodes[n].children.insert(at, (t, c));
            n = c;
        }
        let tick = self.tick;
        self.nodes[n].entry = Some(Entry {
            value,
            bytes,
            last_used: tick,
        });
        self.by_use.insert(tick, n);
        self.bytes += bytes;
        self.raise_newest(n, tick);
        while self.bytes > self.budget_bytes {
            let Some((_, &oldest)) = self.by_use.first_key_value() else {
                break;
            };
            let _ = self.remove(oldest);
        }
    }

    /// Removes and returns the entries whose value satisfies `pred`.
    fn take_where(&mut self, mut pred: impl FnMut(&T) -> bool) -> Vec<T> {
        let leaves: Vec<NodeId> = self
            .by_use
            .values()
            .copied()
            .filter(|&l| self.nodes[l].entry.as_ref().is_some_and(|e| pred(&e.value)))
            .collect();
        leaves.into_iter().filter_map(|l| self.remove(l)).collect()
    }

    fn alloc(&mut self, node: Node<T>) -> NodeId {
        match self.free.pop() {
            Some(i) => {
                self.nodes[i] = node;
                i
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() - 1
            }
        }
    }

    /// Drops the entry at `leaf`, the nodes that no longer lead to any entry, and
    /// updates `newest` above them.
    fn remove(&mut self, leaf: NodeId) -> Option<T> {
        let e = self.nodes[leaf].entry.take()?;
        self.by_use.remove(&e.last_used);
        self.bytes -= e.bytes;
        // Prune the branch that led only to this entry.
        let mut n = leaf;
        while n != ROOT && self.nodes[n].children.is_empty() && self.nodes[n].entry.is_none() {
            let p = self.nodes[n].parent;
            let t = self.nodes[n].token;
            let kids = &mut self.nodes[p].children;
            if let Ok(i) = kids.binary_search_by_key(&t, |&(t, _)| t) {
                kids.remove(i);
            }
            self.nodes[n] = Node::new(ROOT, 0);
            self.free.push(n);
            n = p;
        }
        // Recompute `newest` upward until it no longer changes.
        loop {
            let node = &self.nodes[n];
            let newest = node
                .children
                .iter()
                .map(|&(_, c)| self.nodes[c].newest)
                .chain(node.entry.as_ref().map(|e| e.last_used))
                .max()
                .unwrap_or(0);
            if newest == node.newest {
                break;
            }
            self.nodes[n].newest = newest;
            if n == ROOT {
                break;
            }
            n = self.nodes[n].parent;
        }
        Some(e.value)
    }
}

/// Where a tool result sits in a kept session: the ledger entry that lets a revocation
/// find it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Span {
    /// sha256 hex of the result's text as it entered the prompt.
    pub digest: String,
    /// The call it answered, if named.
    pub tool_call_id: Option<String>,
    /// The first token of its message (the template's header included): every KV entry
    /// from here on may have attended to it.
    pub start: usize,
}

impl Span {
    /// Whether `r` revokes this result (its digest or its call id).
    pub(crate) fn matches(&self, r: &Revocation) -> bool {
        r.digest
            .as_deref()
            .is_some_and(|d| d.eq_ignore_ascii_case(&self.digest))
            || (r.tool_call_id.is_some() && r.tool_call_id == self.tool_call_id)
    }
}

/// The revocations in force: digests (lowercase) and tool-call ids, each looked up in
/// O(1), so that sessions restored at start are checked against a long list quickly.
#[derive(Default)]
pub(crate) struct Revoked {
    digests: HashSet<String>,
    calls: HashSet<String>,
}

impl Revoked {
    /// The sets of `revoked`.
    pub(crate) fn of<'a>(revoked: impl IntoIterator<Item = &'a Revocation>) -> Self {
        let mut r = Revoked::default();
        for x in revoked {
            r.add(x);
        }
        r
    }

    fn add(&mut self, r: &Revocation) {
        if let Some(d) = &r.digest {
            self.digests.insert(d.to_ascii_lowercase());
        }
        if let Some(c) = &r.tool_call_id {
            self.calls.insert(c.clone());
        }
    }

    /// Whether any of them revokes `s`.
    pub(crate) fn matches(&self, s: &Span) -> bool {
        self.digests.contains(&s.digest.to_ascii_lowercase())
            || s.tool_call_id
                .as_ref()
                .is_some_and(|c| self.calls.contains(c))
    }
}

/// A kept session, its ledger and its partition.
struct Kept {
    session: Arc<Session>,
    ledger: Vec<Span>,
    partition: Partition,
}

/// Which requests may share cached KV: a lookup only finds sessions kept in its own
/// partition, so a request's `cached_tokens` never tells anything about another
/// partition's prompts. The gateway derives it from the API key a request authenticated
/// with and the request's `cache_salt` (see `GenerateRequest::cache_partition`).
///
/// In the trie a partition is a tag of [`Partition::TAG_LEN`] leading ids (128 bits of
/// the sha256 of its name) before the token ids, so all partitions share one byte
/// budget and one LRU order, and a revocation reaches every partition.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Partition([u32; Partition::TAG_LEN]);

impl Partition {
    /// Ids the tag takes.
    pub const TAG_LEN: usize = 4;

    /// The partition named `name` (any string; equal names, equal partitions).
    pub fn new(name: &str) -> Self {
        let hex = fak_ctxmmu::digest(name);
        let mut tag = [0u32; Self::TAG_LEN];
        for (i, t) in tag.iter_mut().enumerate() {
            *t = u32::from_str_radix(&hex[8 * i..8 * i + 8], 16).unwrap_or(0);
        }
        Partition(tag)
    }

    /// The trie key of `ids` in this partition: the tag, then the ids.
    fn key(&self, ids: &[u32]) -> Vec<u32> {
        let mut k = Vec::with_capacity(Self::TAG_LEN + ids.len());
        k.extend_from_slice(&self.0);
        k.extend_from_slice(ids);
        k
    }
}

impl Default for Partition {
    /// The partition of the empty name: requests with no key and no salt.
    fn default() -> Self {
        Partition::new("")
    }
}

/// Recent sessions in a token-id prefix tree: longest-prefix lookup, LRU within a byte
/// budget; revoked content cut out (see [`PrefixCache::revoke`]).
pub struct PrefixCache {
    trie: Trie<Kept>,
    revoked: Revoked,
}

/// A lookup hit: a kept session and how many of the prompt's leading tokens it holds.
pub struct Hit {
    /// The kept session (shared; copy it before use).
    pub session: Arc<Session>,
    /// Tokens of the prompt it holds, `< prompt.len()` (at least one prompt token is
    /// always left to prefill, to produce the logits generation starts from).
    pub reuse: usize,
}

impl PrefixCache {
    /// An empty cache holding at most `budget_bytes` of KV entries (0 keeps nothing).
    pub fn new(budget_bytes: usize) -> Self {
        PrefixCache {
            trie: Trie::new(budget_bytes),
            revoked: Revoked::default(),
        }
    }

    /// An empty cache ([`PrefixCache::new`]) with `revoked` in force: a session kept
    /// later (one restored from a file at start) is cut before the first of its spans
    /// any of them matches.
    pub fn with_revoked<'a>(
        budget_bytes: usize,
        revoked: impl IntoIterator<Item = &'a Revocation>,
    ) -> Self {
        PrefixCache {
            revoked: Revoked::of(revoked),
            ..PrefixCache::new(budget_bytes)
        }
    }

    /// Sessions held.
    pub fn len(&self) -> usize {
        self.trie.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of KV entries held, each session counted whole as if alone (a running
    /// total: O(1)). The budget is kept on this figure, so it never admits more than
    /// private copies would take.
    pub fn bytes(&self) -> usize {
        self.trie.bytes
    }

    /// Bytes of memory the kept sessions' KV takes: a prefix they share (a system
    /// prompt several conversations started from, [`fak_kv::KvCache::freeze`]) counted
    /// once ([`fak_kv::KvCache::bytes_held`]). Usually less than [`PrefixCache::bytes`],
    /// and at most twice it (a kept session holds no shared block it reads less than
    /// half of); costs a walk over the kept sessions.
    pub fn bytes_held(&self) -> usize {
        let kept: Vec<Arc<Session>> = self.sessions();
        fak_kv::KvCache::bytes_held(kept.iter().map(|s| s.cache()))
    }

    /// [`PrefixCache::lookup_in`] the default partition.
    pub fn lookup(&mut self, prompt: &[u32]) -> Option<Hit> {
        self.lookup_in(&Partition::default(), prompt)
    }

    /// The session kept in `partition` sharing the longest prefix with `prompt` (ties:
    /// the most recently used), if it shares at least one token. Marks it used. The
    /// shared prefix counts at most `prompt.len() - 1` tokens. Sessions of other
    /// partitions are never found. Costs O(`prompt.len()`).
    pub fn lookup_in(&mut self, partition: &Partition, prompt: &[u32]) -> Option<Hit> {
        let key = partition.key(prompt);
        let limit = key.len().saturating_sub(1);
        let (kept, depth) = self.trie.lookup(&key, limit, Partition::TAG_LEN)?;
        Some(Hit {
            session: Arc::clone(&kept.session),
            reuse: depth - Partition::TAG_LEN,
        })
    }

    /// How many leading tokens of `ids` some session kept in `partition` holds (0:
    /// none). Marks nothing used. Costs O(`ids.len()`).
    pub fn shared_len_in(&self, partition: &Partition, ids: &[u32]) -> usize {
        let (_, depth) = self.trie.walk(&partition.key(ids));
        depth.saturating_sub(Partition::TAG_LEN)
    }

    /// Drops every kept session (a cold cache); revocations stay in force.
    pub fn clear(&mut self) {
        self.trie = Trie::new(self.trie.budget_bytes);
    }

    /// The kept sessions with their ledgers and partitions, most recently used first
    /// (what `fak serve --kv-persist` writes at shutdown).
    pub fn kept(&self) -> Vec<(Arc<Session>, Vec<Span>, Partition)> {
        self.trie
            .by_use
            .values()
            .rev()
            .filter_map(|&leaf| self.trie.nodes[leaf].entry.as_ref())
            .map(|e| {
                let k = &e.value;
                (Arc::clone(&k.session), k.ledger.clone(), k.partition)
            })
            .collect()
    }

    /// The kept sessions, most recently used first (for inspection and tests).
    pub fn sessions(&self) -> Vec<Arc<Session>> {
        self.trie
            .by_use
            .values()
            .rev()
            .filter_map(|&leaf| self.trie.nodes[leaf].entry.as_ref())
            .map(|e| Arc::clone(&e.value.session))
            .collect()
    }

    /// Cuts `r`'s content out of every kept session: each holding it is cut back to the
    /// first token of the earliest matching span (a tail eviction, exact) or dropped
    /// when that is its first token. `r` is remembered, so a session kept later (a
    /// generation that was running when the revocation came) is cut the same way.
    pub fn revoke(&mut self, r: &Revocation) -> RevokeReport {
        self.revoked.add(r);
        let hit = self
            .trie
            .take_where(|k| k.ledger.iter().any(|s| s.matches(r)));
        let mut report = RevokeReport::default();
        for kept in hit {
            report.sessions += 1;
            let before = kept.session.len();
            if let Some(k) = self.cut(kept) {
                report.tokens_dropped += before - k.session.len();
                self.keep(k);
            } else {
                report.tokens_dropped += before;
            }
        }
        report
    }

    /// `k` cut before its earliest revoked span; `None` when nothing would be left.
    fn cut(&self, k: Kept) -> Option<Kept> {
        let Some(at) = k
            .ledger
            .iter()
            .filter(|s| self.revoked.matches(s))
            .map(|s| s.start)
            .min()
        else {
            return Some(k);
        };
        if at == 0 {
            return None;
        }
        let mut session = Arc::unwrap_or_clone(k.session);
        let tail = session.len().saturating_sub(at);
        if tail > 0 {
            // A tail eviction: nothing after the cut, so the cache is exactly the prefix's.
            session.evict(at, tail).ok()?;
        }
        let ledger = k.ledger.into_iter().filter(|s| s.start < at).collect();
        Some(Kept {
            session: Arc::new(session),
            ledger,
            partition: k.partition,
        })
    }

    fn keep(&mut self, k: Kept) {
        if k.session.ids().is_empty() {
            return;
        }
        let bytes = k.session.cache().bytes_used();
        let key = k.partition.key(k.session.ids());
        self.trie.insert(&key, k, bytes);
    }

    /// [`PrefixCache::insert_in`] the default partition.
    pub fn insert(&mut self, session: Session, ledger: Vec<Span>) {
        self.insert_in(&Partition::default(), session, ledger);
    }

    /// Keeps `session` in `partition`. Entries of the partition whose ids are a prefix of its ids are dropped (it covers
    /// them); if it is itself a prefix of kept entries, the most recently used of them
    /// is only marked used. Then least-recently-used entries go until the budget
    /// holds; a session larger than the whole budget is not kept.
    ///
    /// `ledger` says where the session's tool results sit; a session holding revoked
    /// content is cut before it first (see [`PrefixCache::revoke`]).
    pub fn insert_in(&mut self, partition: &Partition, mut session: Session, ledger: Vec<Span>) {
        // Kept to be copied, never stepped: its forward-pass buffers are not needed.
        session.release_buffers();
        // Its entries become a shared block: a later request that starts from it reads
        // the shared prefix in place instead of copying it (`fak_kv::KvCache::freeze`).
        session.freeze();
        let k = Kept {
            session: Arc::new(session),
            ledger,
            partition: *partition,
        };
        if let Some(k) = self.cut(k) {
            self.keep(k);
        }
    }
}

/// A session ready to generate from `prompt`: a copy of the best kept session cut to
/// the shared prefix, or a copy of `empty`. Returns it and the number of prompt tokens
/// reused; the caller prefills `prompt[reused..]` (never empty).
///
/// `empty` is an empty session of the model with the capacity wanted (the context
/// length). Copying it rather than calling `Session::new` each time matters for memory:
/// `Session::new` reserves buffers for the whole context up front, while a copy
/// allocates only what it holds and grows as tokens arrive, so kept sessions cost what
/// they hold.
///
/// # Errors
/// A cache eviction out of range (cannot happen for a hit from [`PrefixCache::lookup`]).
pub fn start_session(
    hit: Option<Hit>,
    empty: &Session,
) -> Result<(Session, usize), fak_kv::SessionError> {
    match hit {
        Some(Hit { session, reuse }) => {
            let mut s = Session::clone(&session);
            let tail = s.len() - reuse;
            if tail > 0 {
                // A tail eviction: nothing after the span, so the cache is exactly the
                // prefix's.
                s.evict(reuse, tail)?;
            }
            Ok((s, reuse))
        }
        None => Ok((empty.clone(), 0)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Checks the trie's invariants: entries only at leaves, every non-root leaf holds
    /// one, `newest` is the largest `last_used` below, `by_use` and `bytes` agree with
    /// the entries, children sorted and pointing back at their parent.
    fn check<T>(t: &Trie<T>) {
        let free: std::collections::HashSet<_> = t.free.iter().copied().collect();
        let mut entries = 0;
        let mut bytes = 0;
        for (i, n) in t.nodes.iter().enumerate() {
            if free.contains(&i) {
                continue;
            }
            assert!(n.children.windows(2).all(|w| w[0].0 < w[1].0), "unsorted");
            for &(tok, c) in &n.children {
                assert!(!free.contains(&c));
                assert_eq!(t.nodes[c].parent, i);
                assert_eq!(t.nodes[c].token, tok);
            }
            if i != ROOT {
                assert_eq!(n.children.is_empty(), n.entry.is_some(), "node {i}");
            } else {
                assert!(n.entry.is_none());
            }
            let below = n
                .children
                .iter()
                .map(|&(_, c)| t.nodes[c].newest)
                .chain(n.entry.as_ref().map(|e| e.last_used))
                .max()
                .unwrap_or(0);
            assert_eq!(n.newest, below, "newest at node {i}");
            if let Some(e) = &n.entry {
                entries += 1;
                bytes += e.bytes;
                assert_eq!(t.by_use.get(&e.last_used), Some(&i));
            }
        }
        assert_eq!(entries, t.by_use.len());
        assert_eq!(bytes, t.bytes);
        assert!(t.bytes <= t.budget_bytes);
    }

    /// Live nodes, the root included.
    fn live_nodes<T>(t: &Trie<T>) -> usize {
        t.nodes.len() - t.free.len()
    }

    /// Entries sized one byte per token.
    fn put(t: &mut Trie<char>, ids: &[u32], tag: char) {
        t.insert(ids, tag, ids.len());
        check(t);
    }

    /// Looks `prompt` up with the cache's limit (`prompt.len() - 1`).
    fn get(t: &mut Trie<char>, prompt: &[u32]) -> Option<(char, usize)> {
        let r = t
            .lookup(prompt, prompt.len().saturating_sub(1), 0)
            .map(|(v, n)| (*v, n));
        check(t);
        r
    }

    #[test]
    fn longest_prefix_across_divergent_entries() {
        let mut t = Trie::new(usize::MAX);
        put(&mut t, &[1, 2, 3, 4, 5, 6], 'a');
        put(&mut t, &[1, 2, 9], 'b');
        put(&mut t, &[1, 2, 3, 7], 'c');
        put(&mut t, &[8, 8], 'd');
        // 'a' diverges from the prompt after four tokens: those four are reusable.
        assert_eq!(get(&mut t, &[1, 2, 3, 4, 0, 0]), Some(('a', 4)));
        assert_eq!(get(&mut t, &[1, 2, 9, 9]), Some(('b', 3)));
        assert_eq!(get(&mut t, &[1, 2, 3, 7, 7]), Some(('c', 4)));
        assert_eq!(get(&mut t, &[8, 1, 1]), Some(('d', 1)));
        assert_eq!(get(&mut t, &[5, 1, 1]), None);
        assert_eq!(t.len(), 4);
    }

    #[test]
    fn ties_go_to_the_most_recently_used() {
        let mut t = Trie::new(usize::MAX);
        put(&mut t, &[1, 2, 3], 'a');
        put(&mut t, &[1, 2, 4], 'b');
        put(&mut t, &[1, 5], 'c');
        assert_eq!(get(&mut t, &[1, 2, 7, 7]), Some(('b', 2)));
        assert_eq!(get(&mut t, &[1, 2, 3, 0]), Some(('a', 3)));
        assert_eq!(get(&mut t, &[1, 2, 7, 7]), Some(('a', 2)));
        // Only [1] is shared (the limit leaves 9 to run): every entry ties.
        assert_eq!(get(&mut t, &[1, 9]), Some(('a', 1)));
    }

    #[test]
    fn the_shared_prefix_leaves_the_last_prompt_token() {
        let mut t = Trie::new(usize::MAX);
        put(&mut t, &[1, 2, 3], 'a');
        assert_eq!(get(&mut t, &[1, 2, 3]), Some(('a', 2)));
        assert_eq!(get(&mut t, &[1, 2, 3, 4]), Some(('a', 3)));
        assert_eq!(get(&mut t, &[1, 2]), Some(('a', 1)));
        assert_eq!(get(&mut t, &[1]), None);
        assert_eq!(get(&mut t, &[]), None);
    }

    #[test]
    fn lru_eviction_order() {
        let mut t = Trie::new(9);
        put(&mut t, &[1, 1, 1], 'a');
        put(&mut t, &[2, 2, 2], 'b');
        put(&mut t, &[3, 3, 3], 'c');
        assert_eq!(t.bytes, 9);
        assert_eq!(get(&mut t, &[1, 1, 0]), Some(('a', 2))); // 'b' is now the oldest
        put(&mut t, &[4, 4, 4], 'd');
        assert_eq!(
            get(&mut t, &[2, 2, 0]),
            None,
            "'b' was the least recently used"
        );
        put(&mut t, &[5, 5, 5], 'e'); // then 'c'
        assert_eq!(get(&mut t, &[3, 3, 0]), None);
        assert_eq!(get(&mut t, &[1, 1, 0]), Some(('a', 2)));
        assert_eq!(get(&mut t, &[4, 4, 0]), Some(('d', 2)));
        // One entry of 6 evicts the two oldest ('e', then 'a').
        put(&mut t, &[6, 6, 6, 6, 6, 6], 'f');
        assert_eq!(t.len(), 2);
        assert_eq!(get(&mut t, &[5, 5, 0]), None);
        assert_eq!(get(&mut t, &[1, 1, 0]), None);
        assert_eq!(get(&mut t, &[4, 4, 0]), Some(('d', 2)));
        // Larger than the whole budget: not kept, nothing evicted.
        put(&mut t, &[7; 10], 'g');
        assert_eq!(t.len(), 2);
        assert_eq!(get(&mut t, &[7, 7]), None);
        // Evicted branches are pruned: the root, 3 nodes for 'd', 6 for 'f'.
        assert_eq!(live_nodes(&t), 10);
    }

    #[test]
    fn prefix_covered_entries_are_dropped() {
        let mut t = Trie::new(10);
        put(&mut t, &[1, 2, 3], 'a');
        put(&mut t, &[1, 2, 3, 4], 'b'); // covers 'a'
        assert_eq!(t.len(), 1);
        assert_eq!(t.bytes, 4);
        assert_eq!(get(&mut t, &[1, 2, 3, 0]), Some(('b', 3)));
        put(&mut t, &[5, 5], 'c');
        // Covered by 'b': not added, but 'b' is marked used, so 'c' is now the oldest.
        put(&mut t, &[1, 2], 'd');
        assert_eq!(t.len(), 2);
        put(&mut t, &[1, 2, 3, 4], 'e'); // equal to 'b': the same
        assert_eq!(t.len(), 2);
        put(&mut t, &[6, 6, 6, 6, 6], 'f'); // 11 bytes: 'c' goes, not 'b'
        assert_eq!(get(&mut t, &[5, 5, 0]), None);
        assert_eq!(get(&mut t, &[1, 2, 3, 4, 0]), Some(('b', 4)));
        assert_eq!(t.bytes, 9);
    }

    /// The scanned list the trie replaced, as the reference (the covering entry an
    /// insert marks used is the most recently used one): (ids, tag, bytes, last used).
    struct Reference {
        entries: Vec<(Vec<u32>, u32, usize, u64)>,
        budget: usize,
        tick: u64,
    }

    impl Reference {
        fn lookup(&mut self, prompt: &[u32]) -> Option<(u32, usize)> {
            let limit = prompt.len().saturating_sub(1);
            let mut best: Option<(usize, usize, u64)> = None;
            for (i, e) in self.entries.iter().enumerate() {
                let common =
                    e.0.iter()
                        .zip(prompt)
                        .take_while(|(a, b)| a == b)
                        .count()
                        .min(limit);
                if common > 0 && best.is_none_or(|(_, r, t)| common > r || (common == r && e.3 > t))
                {
                    best = Some((i, common, e.3));
                }
            }
            let (i, reuse, _) = best?;
            self.tick += 1;
            self.entries[i].3 = self.tick;
            Some((self.entries[i].1, reuse))
        }

        fn insert(&mut self, ids: &[u32], tag: u32, bytes: usize) {
            self.tick += 1;
            if ids.is_empty() || bytes > self.budget {
                return;
            }
            if let Some(e) = self
                .entries
                .iter_mut()
                .filter(|e| e.0.starts_with(ids))
                .max_by_key(|e| e.3)
            {
                e.3 = self.tick;
                return;
            }
            self.entries.retain(|e| !ids.starts_with(&e.0));
            self.entries.push((ids.to_vec(), tag, bytes, self.tick));
            while self.entries.iter().map(|e| e.2).sum::<usize>() > self.budget {
                let oldest = (0..self.entries.len())
                    .min_by_key(|&i| self.entries[i].3)
                    .unwrap();
                self.entries.swap_remove(oldest);
            }
        }
    }

    #[test]
    fn agrees_with_the_scanned_list_on_random_operations() {
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut rand = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let mut t: Trie<u32> = Trie::new(40);
        let mut r = Reference {
            entries: Vec::new(),
            budget: 40,
            tick: 0,
        };
        let (mut hits, mut shrank) = (0, 0);
        for step in 0..20_000u32 {
            let len = rand(9) as usize;
            let ids: Vec<u32> = (0..len).map(|_| rand(3) as u32).collect();
            if rand(2) == 0 {
                let bytes = rand(12) as usize;
                let before = t.len();
                t.insert(&ids, step, bytes);
                r.insert(&ids, step, bytes);
                shrank += usize::from(t.len() < before);
            } else {
                let got = t
                    .lookup(&ids, ids.len().saturating_sub(1), 0)
                    .map(|(v, n)| (*v, n));
                assert_eq!(got, r.lookup(&ids), "step {step}: lookup {ids:?}");
                hits += usize::from(got.is_some());
            }
            check(&t);
            assert_eq!(t.len(), r.entries.len(), "step {step}");
        }
        // The run exercised hits and evictions (an insert that leaves fewer entries
        // evicted at least one besides any it covered).
        assert!(
            hits > 1000 && shrank > 100,
            "{hits} hits, {shrank} shrinking inserts"
        );
    }
}
