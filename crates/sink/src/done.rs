/// Which request indexes of a job have their line: one bit each.
#[derive(Debug, Clone)]
pub struct DoneSet {
    bits: Vec<u64>,
    total: u64,
    len: u64,
}

impl DoneSet {
    /// An empty set for `total` requests.
    pub fn new(total: u64) -> Self {
        Self {
            bits: vec![0; total.div_ceil(64) as usize],
            total,
            len: 0,
        }
    }

    /// Marks `index`; false when it was marked already.
    pub fn insert(&mut self, index: u64) -> bool {
        debug_assert!(index < self.total);
        let (word, bit) = ((index / 64) as usize, 1u64 << (index % 64));
        let fresh = self.bits[word] & bit == 0;
        self.bits[word] |= bit;
        self.len += fresh as u64;
        fresh
    }

    /// Unmarks `index`; false when it was not marked.
    pub fn remove(&mut self, index: u64) -> bool {
        if index >= self.total {
            return false;
        }
        let (word, bit) = ((index / 64) as usize, 1u64 << (index % 64));
        let was = self.bits[word] & bit != 0;
        self.bits[word] &= !bit;
        self.len -= was as u64;
        was
    }

    /// Whether `index` is marked.
    pub fn contains(&self, index: u64) -> bool {
        index < self.total && self.bits[(index / 64) as usize] & (1u64 << (index % 64)) != 0
    }

    /// How many are marked.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether none is marked.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Unmarked indexes in order.
    pub fn missing(&self) -> impl Iterator<Item = u64> + '_ {
        (0..self.total).filter(|&i| !self.contains(i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn behaves_like_a_set(total in 1u64..300, picks in proptest::collection::vec(any::<u64>(), 0..200)) {
            let mut set = DoneSet::new(total);
            let mut model = std::collections::BTreeSet::new();
            for p in picks {
                let i = p % total;
                prop_assert_eq!(set.insert(i), model.insert(i));
            }
            prop_assert_eq!(set.len(), model.len() as u64);
            let missing: Vec<u64> = set.missing().collect();
            let expected: Vec<u64> = (0..total).filter(|i| !model.contains(i)).collect();
            prop_assert_eq!(missing, expected);
        }
    }
}
