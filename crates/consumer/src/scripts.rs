//! The consumer's Lua scripts. Every key a script touches is passed in KEYS and is one of the
//! list's own keys (`{<list>}:...`), so each script is legal in a Redis Cluster.

use std::sync::atomic::{AtomicU64, Ordering};

use batch_keys::ListKeys;
use fred::bytes_utils::Str;
use fred::clients::Client;
use fred::types::scripts::Script;

use crate::Holder;

// Each file's header says what the script does, its KEYS and ARGV.
const TAKE_LUA: &str = include_str!("scripts/take.lua");
const ACK_LUA: &str = include_str!("scripts/ack.lua");
const HAND_ON_LUA: &str = include_str!("scripts/hand_on.lua");
const IDS_LUA: &str = include_str!("scripts/ids.lua");

/// What an acknowledgement did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ack {
    /// Applied; `parked` results were kept for their jobs, the rest of the not-here ones dropped.
    Done { parked: u64 },
    /// The lease is someone else's: nothing was changed.
    LeaseLost,
    /// The in-flight list does not end with what was written: nothing was changed.
    Mismatch,
}

pub(crate) struct Scripts {
    take: Script,
    ack: Script,
    hand_on: Script,
}

impl Default for Scripts {
    fn default() -> Self {
        Self {
            take: Script::from_lua(TAKE_LUA),
            ack: Script::from_lua(ACK_LUA),
            hand_on: Script::from_lua(HAND_ON_LUA),
        }
    }
}

/// Ids starting with `prefix` of the results waiting in `list`, read `chunk` at a time.
pub(crate) async fn ids_in_list(
    client: &Client,
    list: &str,
    prefix: &str,
    chunk: i64,
) -> Result<Vec<String>, fred::error::Error> {
    use fred::interfaces::ListInterface;
    let script = Script::from_lua(IDS_LUA);
    let len: i64 = client.llen(list).await?;
    let mut out = Vec::new();
    let mut start = 0;
    while start < len {
        let ids: Vec<String> = script
            .evalsha_with_reload(
                client,
                vec![list],
                vec![
                    prefix.to_owned(),
                    start.to_string(),
                    (start + chunk - 1).to_string(),
                ],
            )
            .await?;
        out.extend(ids);
        start += chunk;
    }
    Ok(out)
}

fn nonce() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "{}:{}",
        Holder::this_process().instance,
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

impl Scripts {
    pub(crate) async fn take(
        &self,
        client: &Client,
        keys: &ListKeys,
        holder: &str,
    ) -> Result<i64, fred::error::Error> {
        self.take
            .evalsha_with_reload(
                client,
                vec![
                    keys.list.as_str(),
                    keys.inflight.as_str(),
                    keys.lease.as_str(),
                ],
                vec![holder],
            )
            .await
    }

    /// Pushes `moved` (oldest first) onto `to`'s list, naming `from` as where they came from.
    pub(crate) async fn hand_on(
        &self,
        client: &Client,
        to: &ListKeys,
        from: &str,
        moved: &[&Str],
    ) -> Result<i64, fred::error::Error> {
        if moved.is_empty() {
            return Ok(0);
        }
        let mut args: Vec<&str> = Vec::with_capacity(moved.len() + 1);
        args.push(from);
        args.extend(moved.iter().map(|s| &s[..]));
        self.hand_on
            .evalsha_with_reload(
                client,
                vec![to.list.as_str(), to.handed_from.as_str()],
                args,
            )
            .await
    }

    /// `items` in list order (newest first); `not_here` as (list position, job).
    pub(crate) async fn ack(
        &self,
        client: &Client,
        keys: &ListKeys,
        holder: &str,
        items: &[Str],
        not_here: &[(usize, String)],
        now: i64,
    ) -> Result<Ack, fred::error::Error> {
        let (Some(newest), Some(oldest)) = (items.first(), items.last()) else {
            return Ok(Ack::Done { parked: 0 });
        };
        let mut key_list = vec![
            keys.inflight.clone(),
            keys.lease.clone(),
            keys.acked.clone(),
            keys.jobs.clone(),
        ];
        let mut args = vec![
            holder.to_owned(),
            nonce(),
            items.len().to_string(),
            oldest.to_string(),
            newest.to_string(),
            now.to_string(),
        ];
        let mut park: Vec<&(usize, String)> = not_here.iter().collect();
        // Oldest first, so a parked list keeps the dispatcher's order (oldest on the right).
        park.sort_by_key(|p| std::cmp::Reverse(p.0));
        for (pos, job) in park {
            let key = keys.parked_list(job);
            let index = match key_list.iter().position(|k| *k == key) {
                Some(i) => i + 1,
                None => {
                    key_list.push(key);
                    key_list.len()
                }
            };
            args.push(pos.to_string());
            args.push(index.to_string());
            args.push(job.clone());
        }
        let reply: Vec<i64> = self.ack.evalsha_with_reload(client, key_list, args).await?;
        Ok(match reply.as_slice() {
            // This very acknowledgement was applied before its reply was lost.
            [1, -1] => Ack::Done {
                parked: not_here.len() as u64,
            },
            [1, parked] => Ack::Done {
                parked: (*parked).max(0) as u64,
            },
            [-1] => Ack::LeaseLost,
            _ => Ack::Mismatch,
        })
    }
}
