"""Built-in stateful environment classes: inventory, calendar, bank."""

from __future__ import annotations

from typing import Any

from envs.stateful.base import StatefulEnv
from envs.tools import tool


class Inventory(StatefulEnv):
    """A shop's stock and its orders."""

    STATE_FIELDS = ("items", "orders")
    items: dict[str, int]
    orders: list[dict[str, Any]]

    @tool
    def list_items(self) -> str:
        """List every item with its quantity in stock."""
        return ", ".join(f"{k}: {v}" for k, v in sorted(self.items.items())) or "(empty)"

    @tool
    def add_stock(self, item: str, quantity: int) -> str:
        """Add units of an item to the stock.

        Args:
            item: Item name.
            quantity: Units to add (positive).
        """
        if quantity <= 0:
            return "Error: quantity must be positive."
        self.items[item] = self.items.get(item, 0) + quantity
        return f"{item}: {self.items[item]}"

    @tool
    def place_order(self, customer: str, item: str, quantity: int) -> str:
        """Sell units of an item to a customer; fails when stock is short.

        Args:
            customer: Who buys.
            item: Item name.
            quantity: Units to sell (positive).
        """
        if quantity <= 0 or self.items.get(item, 0) < quantity:
            return f"Error: cannot sell {quantity} {item}; in stock: {self.items.get(item, 0)}."
        self.items[item] -= quantity
        self.orders.append({"customer": customer, "item": item, "quantity": quantity})
        return f"Order {len(self.orders)} placed."


class Calendar(StatefulEnv):
    """A week's calendar of events with whole-hour slots."""

    STATE_FIELDS = ("events",)
    events: list[dict[str, Any]]

    @tool
    def list_events(self, day: str) -> str:
        """List the events on a day.

        Args:
            day: Day name, e.g. "monday".
        """
        found = sorted(
            (e for e in self.events if e["day"] == day.lower()), key=lambda e: e["start"]
        )
        return "; ".join(f"{e['title']} {e['start']}-{e['end']}" for e in found) or "(no events)"

    @tool
    def add_event(self, title: str, day: str, start: int, end: int) -> str:
        """Add an event unless it overlaps another on the same day.

        Args:
            title: Event title.
            day: Day name.
            start: Start hour (0-23).
            end: End hour (after start, at most 24).
        """
        if not 0 <= start < end <= 24:
            return "Error: need 0 <= start < end <= 24."
        for e in self.events:
            if e["day"] == day.lower() and start < e["end"] and e["start"] < end:
                return f"Error: overlaps {e['title']}."
        self.events.append({"title": title, "day": day.lower(), "start": start, "end": end})
        return "Added."

    @tool
    def cancel_event(self, title: str) -> str:
        """Remove every event with this title.

        Args:
            title: Event title.
        """
        before = len(self.events)
        self.events = [e for e in self.events if e["title"] != title]
        return f"Removed {before - len(self.events)}."


class Bank(StatefulEnv):
    """Accounts with balances in whole units."""

    STATE_FIELDS = ("accounts", "log")
    accounts: dict[str, int]
    log: list[str]

    @tool
    def balance(self, account: str) -> str:
        """Show an account's balance.

        Args:
            account: Account holder.
        """
        if account not in self.accounts:
            return f"Error: no account {account!r}."
        return str(self.accounts[account])

    @tool
    def transfer(self, source: str, target: str, amount: int) -> str:
        """Move money between accounts; no overdrafts.

        Args:
            source: Paying account.
            target: Receiving account.
            amount: Units to move (positive).
        """
        if source not in self.accounts or target not in self.accounts:
            return "Error: unknown account."
        if amount <= 0 or self.accounts[source] < amount:
            return "Error: invalid amount or insufficient funds."
        self.accounts[source] -= amount
        self.accounts[target] += amount
        self.log.append(f"transfer {source}->{target} {amount}")
        return "Done."

    @tool
    def deposit(self, account: str, amount: int) -> str:
        """Add money to an account.

        Args:
            account: Account holder.
            amount: Units to add (positive).
        """
        if account not in self.accounts or amount <= 0:
            return "Error: unknown account or non-positive amount."
        self.accounts[account] += amount
        self.log.append(f"deposit {account} {amount}")
        return "Done."


CLASSES: dict[str, type[StatefulEnv]] = {"Inventory": Inventory, "Calendar": Calendar, "Bank": Bank}
