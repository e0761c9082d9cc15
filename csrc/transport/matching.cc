#include "transport/matching.h"

#include <cstring>

#include "transport/error.h"

namespace mk {

std::string Matcher::mismatch(const Envelope& env, size_t len, uint64_t check) const {
  if (env.len != len)
    return cat("rank ", rank_, " expected ", len, " bytes from peer ", env.src, " (tag ", env.tag,
               ") but the peer sent ", env.len, " bytes: the ranks disagree on the size of the operation");
  if (env.check != check)
    return cat("rank ", rank_, " and peer ", env.src, " disagree on the operation (tag ", env.tag,
               "): different collective, dtype, count or root on the two ranks");
  return {};
}

void Matcher::bind(Arrival& a, Posted& p) {
  a.req = p.req;
  std::string bad = mismatch(a.env, p.len, p.check);
  if (!bad.empty()) {
    // Take the payload into storage and drop it; the recv fails now.
    a.req = nullptr;
    p.req->fail(bad);
    a.storage.resize(a.env.len);
    a.dst = a.storage.data();
    return;
  }
  if (a.dst == nullptr) {
    a.dst = static_cast<char*>(p.buf);  // payload goes straight into the user's buffer
  } else {
    a.user_buf = p.buf;  // already arriving into storage: copy on delivery
  }
}

ArrivalPtr Matcher::arrive(const Envelope& env) {
  auto a = std::make_shared<Arrival>();
  a->env = env;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = posted_.begin(); it != posted_.end(); ++it) {
    if ((it->src == env.src || it->src == kAnySource) && it->tag == env.tag) {
      Posted p = *it;
      posted_.erase(it);
      bind(*a, p);
      return a;
    }
  }
  a->storage.resize(env.len);
  a->dst = a->storage.data();
  unexpected_.push_back(a);
  return a;
}

void Matcher::delivered(const ArrivalPtr& a) {
  RequestPtr req;
  {
    std::lock_guard<std::mutex> lock(mu_);
    a->delivered = true;
    req = a->req;
    if (req && a->user_buf && a->env.len) std::memcpy(a->user_buf, a->dst, a->env.len);
  }
  if (req) req->complete(a->env.len, a->env.src);
}

RequestPtr Matcher::post_recv(int src, uint64_t tag, void* buf, size_t len, uint64_t check) {
  auto req = std::make_shared<Request>();
  ArrivalPtr ready;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = unexpected_.begin(); it != unexpected_.end(); ++it) {
      ArrivalPtr a = *it;
      if ((src == a->env.src || src == kAnySource) && a->env.tag == tag) {
        unexpected_.erase(it);
        std::string bad = mismatch(a->env, len, check);
        if (!bad.empty()) {
          req->fail(bad);
          return req;
        }
        if (a->delivered) {
          ready = a;
        } else {
          a->req = req;  // still arriving: delivered() copies it into buf
          a->user_buf = buf;
        }
        if (ready) break;
        return req;
      }
    }
    if (!ready) {
      posted_.push_back(Posted{src, tag, buf, len, check, req});
      return req;
    }
  }
  if (ready->env.len) std::memcpy(buf, ready->dst, ready->env.len);
  req->complete(ready->env.len, ready->env.src);
  return req;
}

void Matcher::abandon(const ArrivalPtr& a, const std::string& why) {
  RequestPtr req;
  {
    std::lock_guard<std::mutex> lock(mu_);
    req = a->req;
    a->req = nullptr;
    unexpected_.remove(a);
  }
  if (req) req->fail(why);
}

void Matcher::cancel(const RequestPtr& req, const std::string& why) {
  bool found = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = posted_.begin(); it != posted_.end(); ++it)
      if (it->req == req) {
        posted_.erase(it);
        found = true;
        break;
      }
  }
  if (found) req->fail(why);
}

void Matcher::fail_source(int src, const std::string& why) {
  std::vector<RequestPtr> victims;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = posted_.begin(); it != posted_.end();) {
      if (it->src == src || it->src == kAnySource) {
        victims.push_back(it->req);
        it = posted_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& r : victims) r->fail(why);
}

void Matcher::fail_all(const std::string& why) {
  std::vector<RequestPtr> victims;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& p : posted_) victims.push_back(p.req);
    posted_.clear();
  }
  for (auto& r : victims) r->fail(why);
}

}  // namespace mk
